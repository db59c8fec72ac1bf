"""The log (docs/logging.md): C++ lines reach logging.getLogger("dwgraph") at their level,
one INFO line per make_graphed_callables capture and one DEBUG line per graph, with the
numbers of GraphedCallable.stats(); and dwgraph.summary's table of the same numbers, the
eager peak they are compared with once recorded."""

import logging
import re

import pytest
import torch

import dwgraph


@pytest.fixture
def records():
    logger = logging.getLogger("dwgraph")
    kept = []

    class Keep(logging.Handler):
        def emit(self, record):
            kept.append(record)

    handler = Keep(level=logging.DEBUG)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield kept
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def _capture(device="cpu"):
    torch.manual_seed(0)
    a = dwgraph.nn.Linear(16, 32, delay_wgrad_compute=True, device=device)
    b = dwgraph.nn.LayerNormMLP(32, 64, delay_wgrad_compute=True, device=device)
    return dwgraph.make_graphed_callables(
        (a, b), ((torch.randn(4, 16, device=device),), (torch.randn(4, 32, device=device, requires_grad=True),)))


def test_cpp_lines_reach_python_logging_at_their_level(records):
    for level in (logging.DEBUG, logging.INFO, logging.WARNING):
        dwgraph._C._log_for_test(level, f"line at {level}")
    assert [(r.name, r.levelno, r.getMessage()) for r in records] == [
        ("dwgraph", logging.DEBUG, "line at 10"), ("dwgraph", logging.INFO, "line at 20"),
        ("dwgraph", logging.WARNING, "line at 30")]


def test_lines_below_the_loggers_level_are_not_formatted_or_sent(records):
    logging.getLogger("dwgraph").setLevel(logging.WARNING)
    dwgraph._C._log_for_test(logging.INFO, "dropped")
    _capture()
    assert records == []


def test_one_info_line_per_capture_and_one_debug_line_per_graph(records, device):
    ga, gb = _capture(device)
    st = dwgraph.graphed_handle(ga).stats()
    infos = [r.getMessage() for r in records if r.levelno == logging.INFO]
    debugs = [r.getMessage() for r in records if r.levelno == logging.DEBUG]
    assert len(infos) == 1, infos
    kernels = sum(g["num_kernels"] for g in st["graphs"])
    fmt = dwgraph._C.format_bytes
    m = re.fullmatch(r"make_graphed_callables: captured 2 callables in (\d+\.\d{3}) s: (\d+) graphs, (\d+) kernels; "
                     r"pool (.+) reserved, (.+) live; contributions (.+), static buffers (.+)", infos[0])
    assert m, infos[0]
    assert int(m[2]) == st["num_graphs"] == 6 and int(m[3]) == kernels > 0
    assert m.group(4, 5, 6, 7) == (fmt(st["pool_reserved_bytes"]), fmt(st["pool_allocated_bytes"]),
                                   fmt(st["contribution_bytes"]), fmt(st["static_bytes"]))
    assert debugs == [f"make_graphed_callables: {g['kind']} graph of {g['callable']}: {g['num_kernels']} kernels"
                      for g in st["graphs"]]
    assert [(g["callable"], g["kind"]) for g in st["graphs"]] == [
        (f"graphed callable {i} ('{name}')", kind) for i, name in enumerate(("Linear", "LayerNormMLP"))
        for kind in ("forward", "backward", "backward-dw")]


def test_a_failed_capture_logs_nothing(records):
    lin = dwgraph.nn.Linear(8, 8, delay_wgrad_compute=True)
    with pytest.raises(dwgraph.ArgumentError):
        dwgraph.make_graphed_callables(lin, (torch.randn(2, 7),))  # wrong inner size
    assert [r for r in records if r.levelno >= logging.INFO] == []


def test_summary_tabulates_the_sets_stats():
    ga, gb = _capture()
    st = dwgraph.graphed_handle(ga).stats()
    text = dwgraph.summary((ga, gb))
    assert text == dwgraph.summary(gb)  # any callable of the set describes the whole set
    lines = text.splitlines()
    kernels = sum(g["num_kernels"] for g in st["graphs"])
    assert lines[0] == f"dwgraph: 6 graphs, {kernels} kernels"
    assert lines[1].split() == ["callable", "graph", "kernels"]
    rows = lines[2:8]
    assert [(r.rsplit(None, 2)[0].strip(), r.split()[-2], int(r.split()[-1])) for r in rows] == [
        (g["callable"], g["kind"], g["num_kernels"]) for g in st["graphs"]]
    fmt = dwgraph._C.format_bytes
    assert lines[8:13] == [f"  {name:<15} {fmt(st[key])}" for name, key in (
        ("pool reserved", "pool_reserved_bytes"), ("pool live", "pool_allocated_bytes"),
        ("pool peak", "pool_peak_allocated_bytes"), ("contributions", "contribution_bytes"),
        ("static buffers", "static_bytes"))]
    assert lines[13:] == ["  eager peak      unknown (dwgraph.eager_memory records it)"]
    dwgraph.graphed_handle(ga).record_eager_peak(st["pool_reserved_bytes"] // 2)
    assert dwgraph.summary(gb).splitlines()[13:] == [
        f"  eager peak      {fmt(st['pool_reserved_bytes'] // 2)} (pool reserved "
        f"{st['pool_reserved_bytes'] / (st['pool_reserved_bytes'] // 2):.2f}x)"]


def test_summary_of_several_sets_shows_each():
    # Modules of two separate make_graphed_callables calls: one table per set, in the order
    # their callables come, never only the first set's.
    ga, gb = _capture()
    lone = dwgraph.make_graphed_callables(dwgraph.nn.Linear(8, 8, delay_wgrad_compute=True), (torch.randn(2, 8),))
    text = dwgraph.summary((ga, lone, gb))
    assert text == "\n".join(["set 1 of 2", dwgraph.summary((ga, gb)), "set 2 of 2", dwgraph.summary(lone)])
    assert dwgraph.summary([lone, ga]).startswith("set 1 of 2\n" + dwgraph.summary(lone) + "\nset 2 of 2\n")
    assert dwgraph.summary(torch.nn.ModuleList([ga, gb])) == dwgraph.summary(ga)
    assert dwgraph.graphed_handle(ga).same_set(gb) and not dwgraph.graphed_handle(lone).same_set(ga)
    with pytest.raises(dwgraph.ArgumentError, match=r"element 1 of argument 'graphed' must be .* got int"):
        dwgraph.summary((ga, 3))
    with pytest.raises(dwgraph.ArgumentError, match=r"got an empty tuple"):
        dwgraph.summary(())
    step = dwgraph.graphed_step(lambda x: x * 2)
    with pytest.raises(dwgraph.ArgumentError, match=r"pass a GraphedStep on its own"):
        dwgraph.summary((ga, step))


def test_summary_rejects_what_is_not_a_graphed_callable():
    with pytest.raises(dwgraph.ArgumentError, match=r"Linear was not returned by make_graphed_callables"):
        dwgraph.summary(dwgraph.nn.Linear(2, 2))
    with pytest.raises(dwgraph.ArgumentError, match=r"dwgraph.summary: argument 'graphed' must be .* got int"):
        dwgraph.summary(3)


@pytest.mark.parametrize("nbytes, text", [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
                                          (5 * 2**20, "5.0 MiB"), (3 * 2**30 + 2**29, "3.5 GiB")])
def test_format_bytes(nbytes, text):
    assert dwgraph._C.format_bytes(nbytes) == text


def test_each_replay_is_a_profiler_range_named_after_its_graph():
    # The replayed kernels show which graph they belong to (issue 23: 445 aten::copy_ calls
    # of one replay with nothing to say where they came from).
    lin = dwgraph.nn.Linear(8, 8, delay_wgrad_compute=True)
    g = dwgraph.make_graphed_callables(lin, (torch.randn(4, 8, requires_grad=True),))
    x = torch.randn(4, 8, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        g(x).sum().backward()
        g.backward_dw()
    names = [e.name for e in prof.events()]
    for phase in ("forward", "backward", "backward-dw"):
        wanted = f"dwgraph::replay {phase} graph of graphed callable 0 ('Linear')"
        assert names.count(wanted) == 1, (wanted, sorted({n for n in names if n.startswith("dwgraph::")}))
    # Its kernels are inside the range.
    fwd = next(e for e in prof.events() if e.name.startswith("dwgraph::replay forward"))
    inner = [e for e in prof.events() if e.name.startswith("dwgraph::") and e.name != fwd.name
             and fwd.time_range.start <= e.time_range.start and e.time_range.end <= fwd.time_range.end]
    assert inner, "no kernel of the forward graph inside its range"


def test_graphed_step_lines_say_which_graph_and_what_changed_in_words(records):
    # Not the internal key text: which graph, its tensor arguments, and what changed from
    # the previous capture, each field named as the user knows it.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), dwgraph.nn.Linear(16, 16, delay_wgrad_compute=True))

    def body(x, scale=1.0):
        loss = (model(x) * scale).square().mean()
        loss.backward()
        model[1].backward_dw()
        return loss

    step = dwgraph.graphed_step(body, warmup_iters=1, max_graphs=2)
    for rows, scale, train in ((4, 1.0, True), (4, 1.0, True), (5, 1.0, True), (5, 1.0, True), (5, 2.0, True),
                               (5, 2.0, True), (5, 2.0, False)):
        model.train(train)
        step(torch.randn(rows, 16), scale=scale)
    infos = [r.getMessage() for r in records if r.levelno == logging.INFO and "graphed_step" in r.getMessage()]
    tail = r" in \d+\.\d{3} s: \d+ kernels; pool .+ reserved, .+ live"
    expected = [
        r"graphed_step body: captured graph #1 \(its first; tensor arguments float32\[4, 16\] on cpu\)" + tail,
        r"graphed_step body: captured graph #2 \(what changed from the previous capture: tensor arguments: "
        r"float32\[4, 16\] on cpu -> float32\[5, 16\] on cpu\)" + tail,
        r"graphed_step body: released graph #1 \(tensor arguments float32\[4, 16\] on cpu\), the least recently "
        r"used: max_graphs=2 reached",
        r"graphed_step body: captured graph #3 \(what changed from the previous capture: keyword arguments: "
        r"dict\['scale'\]\[float:1\.0\] -> dict\['scale'\]\[float:2\.0\]\)" + tail,
        r"graphed_step body: released graph #2 .*",
        r"graphed_step body: captured graph #4 \(what changed from the previous capture: training flags: 111 -> "
        r"000\)" + tail,
    ]
    assert len(infos) == len(expected), infos
    for line, pattern in zip(infos, expected):
        assert re.fullmatch(pattern, line), line
        assert "|" not in line and "tupleNone" not in line, f"internal key text in the log: {line}"
