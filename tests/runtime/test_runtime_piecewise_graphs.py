"""PiecewiseGraphs' recording and replay order, on CPU with a stand-in for torch.cuda.CUDAGraph: a captured step
becomes one graph per stretch between attention-op calls, each call is re-run between the pieces at replay on
the runner of that step, its result lands in the buffer the next piece was captured reading, and the buffers
are shared by every key. (Replay equals the uncaptured step on CUDA: tests/e2e/test_e2e_cuda.py.)"""
import torch

from apex_compile.runtime.cuda_graphs import LOGITS_FLOOR, PiecewiseGraphs, _Recorder, piecewise_sizes


class FakeGraph:
    log: list = []
    on_replay = None  # called with the graph's id at each replay (what the piece would read then)

    def capture_begin(self, pool=None, capture_error_mode="global"):
        assert capture_error_mode == "thread_local"
        self.id = len(FakeGraph.log)
        FakeGraph.log.append(("begin", self.id))

    def capture_end(self):
        FakeGraph.log.append(("end", self.id))

    def replay(self):
        FakeGraph.log.append(("replay", self.id))
        if FakeGraph.on_replay is not None:
            FakeGraph.on_replay(self.id)


class Runner:
    """Attention = q * (layer + 1) + a per-runner offset, so replays show which runner served them."""

    def __init__(self, offset):
        self.offset, self.calls, self.results = offset, [], []

    def attention(self, layer_idx, q, k, v, scale, out=None):
        self.calls.append(("attention", layer_idx))
        result = q * (layer_idx + 1) + self.offset
        self.results.append(result.clone())
        return result if out is None else out.copy_(result)

    def offload_launch(self, layer_idx, q, k, v, scale):
        self.calls.append(("offload_launch", layer_idx))
        return q.new_zeros(1)


def forward(runner, x, pool=None):
    """A two-layer 'model' calling the runner the way the attention ops do; `pool` keeps its intermediates
    allocated, as a CUDA graph's memory pool does (the recorded arguments do not own their memory)."""
    h = x + 1
    if pool is not None:
        pool.append(h)
    a = runner.attention(0, h, h, h, 0.5)
    token = runner.offload_launch(1, a, a, a, 0.5)
    b = runner.attention(1, a * 2, a, a, 0.5)
    return b + token


def record(pieces, runner, x, pool=None):
    recorder = _Recorder(runner, pieces)
    recorder.begin()
    out = forward(recorder, x, pool)
    recorder.end()
    return recorder, out


def test_a_step_is_recorded_as_pieces_between_the_calls():
    FakeGraph.log = []
    pieces = PiecewiseGraphs([2, 4, 8], 8, new_graph=FakeGraph)
    x = torch.arange(4.0)
    recorder, out = record(pieces, Runner(0.0), x)
    assert len(recorder.graphs) == 4 and [c.method for c in recorder.calls] == ["attention", "offload_launch",
                                                                                "attention"]
    assert FakeGraph.log == [("begin", 0), ("end", 0), ("begin", 2), ("end", 2), ("begin", 4), ("end", 4),
                             ("begin", 6), ("end", 6)]
    # eager results, returned as views of the persistent buffers: per (method, layer), but one for every layer
    # of a method that writes into its output (the next piece reads it before the next layer's call writes it)
    assert torch.equal(out, (x + 1) * 2 * 2)
    first, last = recorder.calls[0], recorder.calls[2]
    assert first.out.data_ptr() == pieces.buffers[("attention", None, (), torch.float32, x.device)].data_ptr()
    assert last.out.data_ptr() == first.out.data_ptr()
    assert recorder.calls[1].out.data_ptr() == pieces.buffers[("offload_launch", 1, (), torch.float32,
                                                                x.device)].data_ptr()
    # tensor arguments alias the step's tensors without owning them, except those of the async launch
    assert first.args[1].data_ptr() != 0 and first.args[0] == 0 and first.args[4] == 0.5
    launch = recorder.calls[1]
    assert launch.args[1] is launch.args[2]  # the very tensors, kept alive


def test_replay_interleaves_pieces_and_calls_on_the_replaying_runner():
    FakeGraph.log = []
    pieces = PiecewiseGraphs([2, 4, 8], 8, new_graph=FakeGraph)
    x = torch.arange(4.0)
    pool = []
    recorder, out = record(pieces, Runner(0.0), x, pool)
    pieces.pieces[(4, 2)] = (recorder.graphs, recorder.calls, out)
    FakeGraph.log = []
    later = Runner(100.0)
    read = {}
    FakeGraph.on_replay = lambda graph: read.setdefault(graph, recorder.calls[0].out.clone())
    try:
        pieces.replay((4, 2), later)
    finally:
        FakeGraph.on_replay = None
    assert [e for e in FakeGraph.log] == [("replay", 0), ("replay", 2), ("replay", 4), ("replay", 6)]
    assert later.calls == [("attention", 0), ("offload_launch", 1), ("attention", 1)]
    # the first call's result (written by the replaying runner) sits where the next piece reads it when that
    # piece runs; the second layer's call then writes the same buffer (one for every layer)
    assert torch.equal(read[2], (x + 1) + 100.0) and torch.equal(later.results[0], (x + 1) + 100.0)
    assert torch.equal(recorder.calls[2].out, later.results[1])
    assert pieces.replays == 1


def test_buffers_are_shared_across_keys_and_sized_for_the_largest_step():
    pieces = PiecewiseGraphs([2, 4, 8], 8, new_graph=FakeGraph)
    small, _ = record(pieces, Runner(0.0), torch.arange(2.0))
    large, _ = record(pieces, Runner(0.0), torch.arange(8.0))
    assert small.calls[0].out.data_ptr() == large.calls[0].out.data_ptr()
    assert pieces.buffers[("attention", None, (), torch.float32, torch.device("cpu"))].shape[0] == 8


def test_keys_pad_rows_and_logits_rows_to_sizes():
    pieces = PiecewiseGraphs(piecewise_sizes(512), 512, new_graph=FakeGraph)
    assert pieces.key_for(1, 1) == (2, 2)
    assert pieces.key_for(9, 1) == (16, 16)  # logits rows: at least LOGITS_FLOOR, at most the step's rows
    assert pieces.key_for(130, 3) == (160, LOGITS_FLOOR)
    assert pieces.key_for(512, 40) == (512, LOGITS_FLOOR)
    assert pieces.key_for(512, 70) == (512, 96)
    assert pieces.key_for(513, 1) is None
    # a prompt step's logits rows (decode rows + prompts ending) vary; they share one key per padded row count
    assert len({pieces.key_for(300, logits) for logits in range(1, LOGITS_FLOOR + 1)}) == 1
    sizes = piecewise_sizes(512)
    assert sizes[:4] == [2, 4, 8, 16] and sizes[-1] == 512 and all(b > a for a, b in zip(sizes, sizes[1:]))
    assert max(b / a for a, b in zip(sizes, sizes[1:]) if a >= 64) <= 1.5
    assert piecewise_sizes(100) == [2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 100]
