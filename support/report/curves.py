"""The training curves, as small multiples on one shared x-range: one row of CURVES per
chart, drawn for one run (the run's page) or overlaid for several (the comparison page).
`step_values` turns a run into {series key: {step: value}}, and `curve_figure` draws one
row from it.

A row: title, y-axis label, y-axis ("unit" = 0..1; "rate" = from 0 to the data, at most
1; "zero" = from the data, with 0 in view; "free" = from the data; "turns" = 0..T_max),
its series, and the explanation under the chart (HTML; {placeholders} filled from
`curve_facts`). A series is (key, label, colour, style): style "line", "dash", "points"
(held-out dots) or "box" (a stacked bar); a key ending in ":*" is one series per tool
(tool_share:*) or per task kind (reward_kind:*).
"""

from support.report.blocks import OKABE, kind_colors, tool_colors
from support.report.charts import figure, line_chart, num, stacked_bar_chart
from support.report.runs import cap_share, cfg_get, tokens_per_action

CURVES = [
    ("Reward and accuracy", "reward / accuracy", "unit", [
        ("reward_mean", "reward mean (train rollouts)", "blue", "line"),
        ("accuracy", "accuracy (train rollouts)", "green", "dash"),
        ("heldout_accuracy", "held-out accuracy", "orange", "points")],
     "Mean reward R over the step's Q×G rollouts{reward_note} Open dots: held-out accuracy from eval/step_N "
     "(step 0 = before training). Training rollouts sample, exploring on purpose, while a greedy held-out "
     "evaluation (eval.planner_temperature = 0) takes the most likely tool: compare each series with itself, "
     "not with the other.{heldout_note}"),
    ("Reward terms", "mean value", "free", [("reward_term:*", "", "", "line")],
     "The mean of each named term of the reward (reward.terms) over the step's judged rollouts; R is their "
     "weighted sum. With the default, the paper's reward, the one term is the accuracy."),
    ("Training reward per task kind", "reward mean", "unit", [("reward_kind:*", "", "", "line")],
     "Mean reward of the step's training rollouts of each task kind (trajectories/step_N.jsonl). A step draws "
     "each kind in proportion, so a kind has only a few queries per step: expect noise."),
    ("Groups with no learning signal", "share of query groups", "rate", [
        ("zero_variance_groups", "zero-variance groups", "red", "line")],
     "Share of queries whose G rollouts all got the same reward: every A_i is 0, so they teach nothing. "
     "Near 1 means the tasks are too easy or too hard for the current planner."),
    ("Reward spread within groups", "std of R in a group", "zero", [
        ("reward_std", "within-group std, mean over groups", "green", "line")],
     "Standard deviation of the G rewards of a query, averaged over the step's queries. A_i divides by it: "
     "0 for a group means no signal from that query, 0.5 is the most a 0/1 reward can spread."),
    ("KL to the reference policy", "KL(π_θ ‖ π_ref)", "zero", [("kl", "KL", "pink", "line")],
     "k3 estimate of the KL between the trained planner and the frozen initial weights, per planner token, "
     "averaged like the loss (over tokens, turns and rollouts). Penalised with weight β."),
    ("Clip fraction", "share of planner tokens", "rate", [("clip_frac", "clip fraction", "sky", "line")],
     "Share of planner tokens where the clip bites: ρ &lt; 1−ε_low with A &lt; 0, or ρ &gt; 1+ε_high with "
     "A &gt; 0. Always 0 when each batch gets a single update (ρ = 1 on the first pass)."),
    ("Tool-call error rate", "errors / tool calls", "rate", [
        ("tool_error_rate", "train rollouts", "red", "line"),
        ("heldout_tool_error_rate", "held-out", "orange", "points")],
     "Failed tool calls (bad plan, tool error) over all tool calls. The paper reports it falls with training."),
    ("Tool shares during training", "share of tool calls", "unit", [("tool_share:*", "", "", "line")],
     "Which tools the planner picks in the training rollouts, as a share of all tool calls of the step."),
    ("Tokens per planner action", "tokens", "zero", [
        ("tokens_per_action", "mean tokens per action", "blue", "line"),
        ("planner_cap", "max_new_tokens", "grey", "dash")],
     "Mean length of the planner's sampled action{tokens_note}. An action that reaches max_new_tokens is cut "
     "there, often mid-word in its sub-goal."),
    ("Cut, loose and out of turns", "share", "rate", [
        ("cap_share", "actions cut at max_new_tokens", "red", "line"),
        ("cap_share_min", "actions cut at max_new_tokens (at least)", "red", "dash"),
        ("loose_share", "tool name matched loosely", "orange", "line"),
        ("no_tool_share", "no tool named", "pink", "line"),
        ("out_of_turns_share", "trajectories out of turns", "sky", "line")],
     "Per training step: planner actions stopped by the token limit{cap_note}; actions whose tool line did not "
     "name a tool exactly (read through an alias, e.g. 'Python' as Python_Coder) or named none; trajectories "
     "that used every turn without the verifier saying STOP."),
    ("Policy entropy", "nats per token", "zero", [("entropy", "entropy", "green", "line")],
     "Mean entropy of the planner's (temperature-scaled) next-token distribution over its action tokens. "
     "A collapse towards 0 means the planner stopped exploring."),
    ("Gradient norm", "‖g‖ before clipping", "zero", [("grad_norm", "grad norm", "blue", "line")],
     "Gradient norm per optimizer step, before it is clipped to train.max_grad_norm. Only the KL term pushes "
     "when every group has zero variance."),
    ("Turns per trajectory", "mean turns", "turns", [("mean_turns", "mean turns", "orange", "line")],
     "Mean planner turns per training rollout{budget_note}; the verifier stops a trajectory early when memory "
     "is enough."),
    ("Loss", "−J", "free", [("loss", "loss", "grey", "line")],
     "The minimised Flow-GRPO objective −J (clipped surrogate + β·KL). Its level is not comparable across "
     "steps: advantages are renormalised per group."),
    ("Sampler vs trainer log-prob gap", "|Δ log-prob|", "zero", [("logprob_gap", "log-prob gap", "pink", "line")],
     "Largest difference between a token's log-prob recorded while sampling and the one the loss recomputes "
     "before the first update. Should stay ~0 (float noise): the update is on-policy."),
    ("Time per step", "seconds", "zero", [
        ("time_rollout", "rollout", "blue", "box"), ("time_judge", "judge", "orange", "box"),
        ("time_update", "update", "green", "box")],
     "Wall time of each step, split into rollout, judge and update."),
]
# On a comparison page a run is a colour and its series differ by dash: (SVG pattern, legend style).
DASHES = [(None, "line"), ("6 4", "dash"), ("2 3", "dotted"), ("9 3 2 3", "dashdot")]


def step_values(run: dict) -> dict[str, dict[int, float]]:
    """{series key: {step: value}} for every key CURVES can name: the metrics rows' own
    keys, held-out points from eval/step_N, and what the trajectories give (reward per
    kind, spread, tokens, cut and loose shares)."""
    vals: dict[str, dict[int, float]] = {}

    def put(key, step, v):
        if num(v) is not None:
            vals.setdefault(key, {})[step] = num(v)

    colors = tool_colors(run)
    for r in run["metrics"]:
        for k, v in r.items():
            if k != "step":
                put(k, r["step"], v)
        if r.get("tool_shares"):
            for t in colors:
                put(f"tool_share:{t}", r["step"], r["tool_shares"].get(t, 0.0))
        for term, v in (r.get("reward_terms") or {}).items() if isinstance(r.get("reward_terms"), dict) else ():
            put(f"reward_term:{term}", r["step"], v)
    for s, e in run["evals"].items():
        put("heldout_accuracy", s, e["summary"].get("accuracy"))
        put("heldout_tool_error_rate", s, e["summary"].get("tool_error_rate"))
    cap = num(cfg_get(run["config"], "agent.planner.max_new_tokens"))
    for step, st in run["train_stats"].items():
        for kind, v in st["reward_kind"].items():
            put(f"reward_kind:{kind}", step, v)
        put("reward_std", step, st["reward_std"])
        mean = tokens_per_action(run, step, st)
        put("tokens_per_action", step, mean)
        if mean is not None:
            put("planner_cap", step, cap)
        share, exact = cap_share(st, mean, cap)
        put("cap_share" if exact else "cap_share_min", step, share)
        if st.get("actions"):
            put("loose_share", step, st.get("loose", 0) / st["actions"])
            put("no_tool_share", step, st.get("no_tool", 0) / st["actions"])
        if st.get("trajectories"):
            put("out_of_turns_share", step, st.get("out_of_turns", 0) / st["trajectories"])
    return vals


def curve_facts(run: dict, vals: dict) -> dict[str, str]:
    """What the explanations of CURVES fill in."""
    same = vals.get("reward_mean") == vals.get("accuracy")
    max_turns = num(cfg_get(run["config"], "agent.max_turns"))
    cap = num(cfg_get(run["config"], "agent.planner.max_new_tokens"))
    exact = "cap_share" in vals
    return {"reward_note": " (= accuracy: the rewards are 0/1)." if same else
            "; accuracy = share of rollouts with R &gt; 0.",
            "heldout_note": "" if vals.get("heldout_accuracy") else " No held-out points: no eval/step_N yet.",
            "budget_note": f" (budget T_max = {max_turns:g})" if max_turns else "",
            "tokens_note": f" (cap: max_new_tokens = {cap:g}, dashed)" if cap else "",
            "cap_note": "" if exact or "cap_share_min" not in vals else
            " (dashed: a lower bound from the mean length, since this run's logs do not record why each action "
            "ended: actions below the cap have at most cap − 1 tokens)"}


def expand_series(run: dict, specs: list, vals: dict) -> list[tuple[str, str, str, str]]:
    """CURVES series with their colours resolved, ":*" keys expanded, and series that carry
    no data (or repeat the reward line) dropped."""
    out = []
    for key, label, color, style in specs:
        if key == "tool_share:*":
            out += [(f"tool_share:{t}", t, c, style) for t, c in tool_colors(run).items()
                    if f"tool_share:{t}" in vals]
        elif key in ("reward_kind:*", "reward_term:*"):
            prefix = key[:-1]
            names = [k[len(prefix):] for k in vals if k.startswith(prefix)]
            out += [(prefix + k, k, c, style) for k, c in kind_colors(names).items()]
        elif key in vals and not (key == "accuracy" and vals[key] == vals.get("reward_mean")):
            out.append((key, label, OKABE.get(color, color), style))
    return out


def x_extent(valses: list[dict]) -> tuple[float, float] | None:
    """One x-range for every small chart: the steps any CURVES series covers, half a step
    of margin each side (where the time bars need it)."""
    keys = {k for _, _, _, specs, _ in CURVES for k, *_ in specs}
    steps = [s for vals in valses for k, v in vals.items() if k in keys or k.split(":")[0] + ":*" in keys
             for s in v]
    return (min(steps) - 0.5, max(steps) + 0.5) if steps else None


def curve_figure(row: tuple, entries: list[tuple], x_range) -> str:
    """One CURVES row as a figure. entries: (run, vals, facts, label, colour) per run; with
    one entry the series keep their own colours, with several each run has its colour and
    its series differ by dash."""
    title, y_label, axis, specs, explain = row
    multi = len(entries) > 1
    drawn, keys, stacks, grey_keys = [], [], [], {}
    for run, vals, facts, label, run_color in entries:
        for i, (key, name, color, style) in enumerate(expand_series(run, specs, vals)):
            xs = sorted(vals[key])
            ys = [vals[key][x] for x in xs]
            grey_keys.setdefault(name, "dot" if style == "points" else DASHES[i % len(DASHES)][1])
            if style == "box" and not multi:
                stacks.append({"name": name, "color": color, "ys": ys, "xs": xs})
                continue
            if style == "box":  # overlaid runs: each part of the time as its own line
                style = "line"
            dash = DASHES[i % len(DASHES)][0] if multi else (style == "dash")
            drawn.append({"name": f"{label}: {name}" if multi else name, "xs": xs, "ys": ys,
                          "color": run_color if multi else color, "dash": dash, "points": style == "points"})
            if not multi:
                keys.append((name, color, "dot" if style == "points" else style))
        if multi:
            keys.append((label, run_color, "line"))
    if multi and len(grey_keys) > 1:  # then one key per series, in grey, with its dash (the same in every run)
        keys += [(n, "#555", style) for n, style in grey_keys.items()]
    facts = entries[0][2]
    missing = f"metrics.jsonl has no '{specs[0][0].split(':')[0].replace('tool_share', 'tool_shares')}'"
    if stacks:
        xs = sorted({x for s in stacks for x in s["xs"]})
        svg = stacked_bar_chart(xs, [{"name": s["name"], "color": s["color"],
                                      "ys": [dict(zip(s["xs"], s["ys"])).get(x) for x in xs]} for s in stacks],
                                y_label, x_range=x_range)
        keys = [(s["name"], s["color"], "box") for s in stacks]
    elif drawn:
        max_turns = max((num(cfg_get(e[0]["config"], "agent.max_turns")) or 0 for e in entries), default=0)
        y_min, y_max, zero, y_cap = {"unit": (0, 1, False, None), "rate": (None, None, True, 1.0),
                                     "zero": (None, None, True, None), "free": (None, None, False, None),
                                     "turns": (0 if max_turns else None, max_turns or None, True, None)}[axis]
        svg = line_chart(drawn, y_label, y_min=y_min, y_max=y_max, zero=zero, x_range=x_range, y_cap=y_cap)
    else:
        svg = None
    if not multi and len(keys) == 1 and keys[0][2] == "line":
        keys = []  # the title says what the one line is
    return figure(title, svg, explain.format(**facts), keys or None, missing)
