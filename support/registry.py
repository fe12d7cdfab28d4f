"""Named functions a config names: the turn scores, the advantage estimators, the planner's
views of the memory. A fork adds one with the registry's decorator, in a module of its own
listed in reward.modules, and names it in the config; no core file changes."""

from support.config import ConfigError


class Registry(dict):
    """name -> function, in the order they registered. `key` is the config key that names
    one, `what` what a function is, `decorator` how a fork adds one (for the messages)."""

    def __init__(self, key: str, what: str, decorator: str):
        super().__init__()
        self.key, self.what, self.decorator = key, what, decorator

    def add(self, name: str):
        """A decorator: the function it decorates is registered as `name`."""
        def add(fn):
            self[name] = fn
            return fn
        return add

    def named(self, name: str):
        """The function registered as `name`; a ConfigError that lists the known ones otherwise."""
        if name not in self:
            raise ConfigError(f"{self.key}: unknown {self.what} {name!r}; known: {', '.join(self)} (one of your "
                              f"own: @{self.decorator} in a module listed in reward.modules)")
        return self[name]
