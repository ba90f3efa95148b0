"""Continuous batching (runtime/slots.py, runtime/serving/continuous.py): rows that join a running batch at
different times, prefilled in chunks between the others' decode steps, give generate()'s tokens for the same
prompt alone (float64 on the CPU, where a batch's rounding cannot hide a wrong state), with and without MTP; a
seeded row draws the same tokens whatever its neighbours; and over real HTTP a short request is answered while a
long prompt prefills, which then completes with the tokens it makes alone - or stops prefilling once its client
goes away."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
import torch

from npuport.fixtures.train_tiny import trained_tiny_path
from npuport.runtime import graphs, slots
from npuport.runtime.generate import SYNC_EVERY, generate
from npuport.runtime.loader import load_model
from npuport.runtime.prefill import GRAPH_PREFILL_POSITIONS
from npuport.runtime.run_options import run_options
from npuport.runtime.sampling import SamplingParams
from npuport.runtime.serving import continuous
from npuport.runtime.serving.batching import Job
from npuport.runtime.serving.continuous import WIDTH_STEP, ContinuousBatcher, chunk_width, group_width, warm_up_shapes
from npuport.runtime.serving.serve import make_server
from npuport.runtime.slots import (
    GRAPH_PREFILL_CAPACITY,
    GRAPH_PREFILL_SHAPES,
    ChunkRow,
    RowSampling,
    decode_slots,
    graph_prefill_shape,
    graph_width,
    move_slots,
    open_slots,
    pool_of,
    prefill_slots,
    warm_up_prefill,
)
from npuport.runtime.text_completions import RuntimeCompletions, TextRequest

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def model64():
    return load_model(trained_tiny_path(), "cpu", torch.float64)


def prompts(count: int, seed: int, low: int = 5, high: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    return [torch.randint(10, 2000, (n,), generator=g).tolist() for n in lengths]


def prefill_alone(model, slot: int, prompt: list[int], width: int) -> int:
    """Prefill one prompt into `slot` in chunks of `width`; its first token."""
    first = None
    for s in range(0, len(prompt), width):
        after = prompt[s + width] if s + width < len(prompt) else None
        first = prefill_slots(model, slot, [ChunkRow(prompt[s:s + width], after)], width,
                              [RowSampling()] if s == 0 else None)[0]
    return first


def joining_schedule(model, options, rows: list[list[int]], new: int) -> list[list[int]]:
    """Four prompts through a pool of 4 slots: the first two prefilled together (chunks of 7), decoding while the
    third and then the fourth join (chunks of 11); at least `new` tokens each, in order."""
    open_slots(model, options, 4, 256)
    made: list[list[int]] = []
    # a group of two prompts of different lengths, chunks of 7, then two more joining one at a time
    firsts = [None, None]
    for s in range(0, max(len(rows[0]), len(rows[1])), 7):
        chunk = []
        for p in rows[:2]:
            part = p[s:s + 7]
            chunk.append(ChunkRow(part, p[s + 7] if s + 7 < len(p) else None))
        got = prefill_slots(model, 4, chunk, 7, [RowSampling()] * 2 if s == 0 else None)
        firsts = [f if f is not None else g for f, g in zip(firsts, got, strict=True)]
    move_slots(model, [4, 5], [0, 1])
    made += [[firsts[0]], [firsts[1]]]
    for joining in (2, 3):
        for result in decode_slots(model, joining, 3):
            for row in range(joining):
                made[row] += result.tokens[row]
        made.append([prefill_alone(model, 4 + joining, rows[joining], 11)])
        move_slots(model, [4 + joining], [joining])
    while min(len(m) for m in made) < new:
        for result in decode_slots(model, 4, 2):
            for row in range(4):
                made[row] += result.tokens[row]
    return [m[:new] for m in made]


@pytest.mark.parametrize("k", [0, 1, 2])
def test_rows_joining_a_running_batch_make_the_tokens_they_make_alone(model64, k):
    options = run_options(model64, k)
    rows, new = prompts(4, seed=k), 24
    alone = [generate(model64, [p], new, options).tokens[0] for p in rows]
    assert joining_schedule(model64, options, rows, new) == alone


def test_a_row_that_leaves_gives_its_slot_to_the_last_and_the_others_go_on_unchanged(model64):
    options = run_options(model64, 0)
    rows = prompts(3, seed=7)
    alone = [generate(model64, [p], 20, options).tokens[0] for p in rows]
    open_slots(model64, options, 3, 256)
    made = [[prefill_alone(model64, 3, p, 16)] for p in rows[:1]]
    move_slots(model64, [3], [0])
    for i in (1, 2):
        made.append([prefill_alone(model64, 3, rows[i], 16)])
        move_slots(model64, [3], [i])
    for result in decode_slots(model64, 3, 4):
        for row in range(3):
            made[row] += result.tokens[row]
    move_slots(model64, [2], [0])  # row 0 leaves: the last row takes its slot
    made = [made[2], made[1]]
    for result in decode_slots(model64, 2, 15):
        for row in range(2):
            made[row] += result.tokens[row]
    assert made[0][:20] == alone[2] and made[1][:20] == alone[1]


class Recorder:
    """A job's streamed tokens per row."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}

    def __call__(self, row: int, new: list[int]) -> None:
        self.tokens.setdefault(row, []).extend(new)


@pytest.fixture(scope="module")
def runner64():
    return RuntimeCompletions.load(trained_tiny_path(), device="cpu", dtype="float64", batch_size=4)


def test_the_batcher_answers_as_generate_streams_and_samples_from_each_rows_own_seed(runner64):
    batcher = ContinuousBatcher(runner64, 4, prefill_tokens=16)
    try:
        rows = prompts(3, seed=3)
        greedy = [Job([TextRequest(p, 12 + i)], SamplingParams(), on_tokens=Recorder()) for i, p in enumerate(rows)]
        seeded = Job([TextRequest(rows[0], 10)] * 2, SamplingParams(temperature=1.0, seed=5))
        alone_seeded = Job([TextRequest(rows[0], 10)] * 2, SamplingParams(temperature=1.0, seed=5))
        for job in [*greedy, seeded]:
            batcher.submit(job)
        answers = [job.future.result(timeout=120) for job in [*greedy, seeded]]
        batcher.submit(alone_seeded).result(timeout=120)
    finally:
        batcher.close(30)
    for job, answer, p in zip(greedy, answers[:3], rows, strict=True):
        expected = generate(runner64.model, [p], job.rows[0].max_tokens, runner64.options,
                            stop_tokens=runner64.stop_tokens).tokens[0]
        assert answer[0].result.token_ids == expected
        assert job.on_tokens.tokens[0] == expected  # streamed: every token once, in order
    seeded_tokens = [a.result.token_ids for a in answers[-1]]
    assert seeded_tokens == [a.result.token_ids for a in alone_seeded.future.result()]
    assert seeded_tokens[0] != seeded_tokens[1]  # two rows of one seed draw apart


# -- over HTTP: a long prefill does not hold up a short request -------------------------------------------------

def post_ids(url: str, prompt: list[list[int]], max_tokens: int, timeout: float) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


LONG_PROMPTS, LONG_TOKENS = 4, 4096  # 16k positions: seconds of prefill in chunks of 256 positions a row


@pytest.fixture(scope="module")
def long_request() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return torch.randint(10, 2000, (LONG_PROMPTS, LONG_TOKENS), generator=g).tolist()


def test_a_short_request_is_answered_while_a_long_prompt_prefills_which_then_makes_its_own_tokens(long_request):
    runner = RuntimeCompletions.load(trained_tiny_path(), device="cpu", dtype="float32", batch_size=8)
    server = make_server(runner, "tiny")
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        alone = post_ids(server.url, long_request, 6, 300)
        started, long_answer = threading.Event(), {}

        def send_long() -> None:
            started.set()
            long_answer.update(post_ids(server.url, long_request, 6, 300))

        thread = threading.Thread(target=send_long)
        thread.start()
        started.wait()
        time.sleep(1.0)  # the long prompt is prefilling
        begin = time.monotonic()
        short = post_ids(server.url, [[5, 6, 7, 8]], 2, 60)
        waited = time.monotonic() - begin
        assert thread.is_alive(), "the long prefill ended before the short request was sent: make it longer"
        thread.join(300)
    finally:
        server.shutdown()
        server.server_close()
    assert short["usage"]["completion_tokens"] == 2 and waited < 2.0
    assert [c["text"] for c in long_answer["choices"]] == [c["text"] for c in alone["choices"]]


def test_a_cancelled_request_stops_its_prefill(runner64, long_request, monkeypatch):
    chunks: list[int] = []
    prefill = runner64.prefill_slots

    def counted(first, chunk, width, samplers=None, spare=0):
        chunks.append(first)
        return prefill(first, chunk, width, samplers, spare)

    monkeypatch.setattr(runner64, "prefill_slots", counted)
    batcher = ContinuousBatcher(runner64, 4, prefill_tokens=64)
    try:
        job = Job([TextRequest(p, 4) for p in long_request], SamplingParams())
        batcher.submit(job)
        deadline = time.monotonic() + 60
        while len(chunks) < 3 and not job.future.done():
            assert time.monotonic() < deadline, "the long request's prefill did not start"
            time.sleep(0.01)
        job.cancel()
        answers = job.future.result(timeout=60)
        after_cancel = len(chunks)
        short = batcher.submit(Job([TextRequest([5, 6, 7], 2)], SamplingParams())).result(timeout=60)
    finally:
        batcher.close(30)
    assert {a.result.completion.finish_reason for a in answers} == {"cancelled"}
    assert after_cancel < LONG_TOKENS // 16  # 256 chunks of 16 tokens for the whole prompt: far from all ran
    assert short[0].result.completion.completion_tokens == 2


def test_prefill_chunks_run_at_the_width_their_prompts_need_in_multiples_of_16(runner64, monkeypatch):
    """A lone 100-token prompt under a 1,024-position budget prefills at width 112, not 1,024; three 700-token
    prompts admitted together take 1,024 / 3 = 341 -> 336 positions a row a chunk, their last chunk the 28 left
    (-> 32); every answer is generate()'s alone."""
    widths: list[tuple[int, int]] = []  # (width, longest part) of each chunk
    free: list[tuple[int, int]] = []  # (first slot, free slots after the chunk's) of each chunk
    prefill = runner64.prefill_slots

    def recorded(first, chunk, width, samplers=None, spare=0):
        widths.append((width, max(len(part.tokens) for part in chunk)))
        free.append((first, spare))
        return prefill(first, chunk, width, samplers, spare)

    monkeypatch.setattr(runner64, "prefill_slots", recorded)
    batcher = ContinuousBatcher(runner64, 4, prefill_tokens=1024)
    g = torch.Generator().manual_seed(2)
    lone = torch.randint(10, 2000, (100,), generator=g).tolist()
    three = torch.randint(10, 2000, (3, 700), generator=g).tolist()
    try:
        lone_answer = batcher.submit(Job([TextRequest(lone, 3)], SamplingParams())).result(timeout=120)
        lone_widths = list(widths)
        three_answer = batcher.submit(Job([TextRequest(p, 3) for p in three], SamplingParams())).result(timeout=120)
    finally:
        batcher.close(30)
    assert lone_widths == [(112, 100)]
    assert widths[len(lone_widths):] == [(336, 336), (336, 336), (32, 28)]
    assert free == [(4, 3)] + [(4, 1)] * 3  # staging slots 4..7: what a chunk padded as a graph may run over
    for prompt, answer in zip([lone, *three], [*lone_answer, *three_answer], strict=True):
        assert answer.result.token_ids == generate(runner64.model, [prompt], 3, runner64.options,
                                                   stop_tokens=runner64.stop_tokens).tokens[0]


def test_the_batcher_captures_the_decode_steps_whenever_it_makes_or_grows_its_pool(runner64, monkeypatch):
    """The pool is made at the first admission and doubled when a longer request comes: each time the decode
    graphs are captured at once (slots.capture_decode_steps; on a GPU, tests/test_kernels_on_gpu.py), not while
    clients wait for a step of a batch size met later."""
    calls: list[int] = []
    monkeypatch.setattr(runner64, "capture_decode_steps", lambda: calls.append(1) or 0)
    batcher = ContinuousBatcher(runner64, 4, prefill_tokens=64)
    try:
        batcher.submit(Job([TextRequest([5, 6, 7], 2)], SamplingParams())).result(timeout=60)
        batcher.submit(Job([TextRequest([5, 6, 7], 2)], SamplingParams())).result(timeout=60)
        assert len(calls) == 1
        longer = torch.randint(10, 2000, (batcher.capacity + 10,), generator=torch.Generator().manual_seed(0))
        batcher.submit(Job([TextRequest(longer.tolist(), 2)], SamplingParams())).result(timeout=120)
    finally:
        batcher.close(30)
    assert len(calls) == 2


def test_rows_decode_one_round_an_iteration_while_a_group_prefills_and_up_to_sync_every_else(runner64, monkeypatch):
    """While a prompt is prefilled in chunks, the rows already decoding run one step an iteration (on a device a
    step of a few rows costs about what one of the whole batch does: the newcomer should join within steps, not
    after eight per chunk); once no group prefills they run SYNC_EVERY between two looks of the host. Both rows
    still get generate()'s tokens."""
    calls: list[tuple[int, bool]] = []
    batcher = ContinuousBatcher(runner64, 4, prefill_tokens=16)
    decode = runner64.decode_slots
    monkeypatch.setattr(runner64, "decode_slots",
                        lambda n, rounds: calls.append((rounds, bool(batcher.groups))) or decode(n, rounds))
    short, long = prompts(1, 5, 5, 6)[0], prompts(1, 6, 120, 121)[0]
    decoding = threading.Event()
    try:
        first = batcher.submit(Job([TextRequest(short, 60)], SamplingParams(),
                                   on_tokens=lambda row, new: decoding.set()))
        assert decoding.wait(60)
        second = batcher.submit(Job([TextRequest(long, 20)], SamplingParams()))
        answers = [first.result(timeout=120)[0], second.result(timeout=120)[0]]
    finally:
        batcher.close(30)
    while_prefilling = [rounds for rounds, prefilling in calls if prefilling]
    assert len(while_prefilling) >= 5 and set(while_prefilling) == {1}  # 120 tokens in chunks of 16
    assert max(rounds for rounds, prefilling in calls if not prefilling) == SYNC_EVERY
    for prompt, answer, new in zip([short, long], answers, [60, 20], strict=True):
        assert answer.result.token_ids == generate(runner64.model, [prompt], new, runner64.options,
                                                   stop_tokens=runner64.stop_tokens).tokens[0]


def triton_class(rows: int) -> int:
    """How Triton specialises an integer argument: 1, divisible by 16, or neither (stood for by 1, 16 and 2)."""
    return 1 if rows == 1 else 16 if rows % 16 == 0 else 2


@pytest.mark.parametrize("budget", [4096, 3000, 1024])
def test_the_warm_up_meets_every_chunk_shape_the_batcher_can_form(budget):
    """Every prefill chunk a batcher of this budget can run - any rows up to budget / 16, every width its group
    and prompts give - falls in a warmed (Triton class of its rows, power of two of its rows x width) pair, so it
    compiles no kernel and tunes no GEMM while clients wait; no warm-up chunk exceeds the budget."""
    shapes = warm_up_shapes(budget)
    warmed = {(triton_class(rows), (rows * width - 1).bit_length()) for rows, width in shapes}
    assert all(rows * width <= budget and width % WIDTH_STEP == 0 for rows, width in shapes)
    for rows in range(1, budget // WIDTH_STEP + 1):
        width = group_width(budget, rows)
        for longest in range(1, width + 1):
            m = rows * chunk_width(width, longest)
            assert m <= budget
            assert (triton_class(rows), (m - 1).bit_length()) in warmed, (rows, longest)


@pytest.fixture
def graph_device(monkeypatch):
    """The CPU taken for a device that captures graphs, where slots pads prefill chunks (graph_prefill_shape): the
    padded chunks run eagerly here (the run options say no graphs), with the static shapes a graph captures."""
    monkeypatch.setattr(slots, "graphs_supported", lambda device: True)
    monkeypatch.setattr(graphs, "graphs_supported", lambda device: True)  # Steps' padded prefill


def pool_with(model, rows: int, capacity: int = 256):
    open_slots(model, run_options(model, 0), rows, capacity)
    return pool_of(model)


@pytest.mark.parametrize("budget", [16384, 4096, 1024])
def test_the_warm_up_meets_every_chunk_padded_to_run_as_a_graph(model64, budget, graph_device):
    """Every shape slots.graph_prefill_shape pads a chunk of the batcher's to (any rows of a 64-row pool, any width
    up to the budget's) falls in a pair warm_up_shapes(budget, GRAPH_PREFILL_POSITIONS) warms - so a graph's capture
    tunes no GEMM while clients wait - and runs at most GRAPH_PREFILL_POSITIONS positions, in widths of multiples of
    16."""
    shapes = warm_up_shapes(budget, GRAPH_PREFILL_POSITIONS)
    warmed = {(triton_class(rows), (rows * width - 1).bit_length()) for rows, width in shapes}
    pool = pool_with(model64, 64)
    met = 0
    for rows in range(1, 65):
        for width in range(1, group_width(budget, rows) + 1):
            shape = graph_prefill_shape(pool, pool.rows, rows, width, spare=64 - rows)
            if shape is None:
                continue
            padded_rows, padded = shape
            met += 1
            assert padded_rows >= rows and width <= padded and padded % WIDTH_STEP == 0
            assert padded_rows * padded <= GRAPH_PREFILL_POSITIONS
            assert (triton_class(padded_rows), (padded_rows * padded - 1).bit_length()) in warmed, (rows, width)
    assert met > 1000


def test_graph_widths_are_multiples_of_16_at_most_a_quarter_wider_from_64_on_and_four_to_an_octave():
    widths = [graph_width(w) for w in range(1, 16385)]
    for w, padded in enumerate(widths, start=1):
        assert w <= padded <= (w + 15 if w < 64 else w * 5 // 4) and padded % 16 == 0, w
    for octave in range(6, 14):  # widths of 64..16383
        assert len({p for w, p in enumerate(widths, start=1) if 1 << octave <= w < 2 << octave}) <= 5, octave


def test_a_chunk_is_padded_only_from_the_first_staging_slot_within_its_free_slots_and_limits(model64, monkeypatch):
    """slots.graph_prefill_shape: rows padded to the decode graphs' buckets (powers of two to 8, then multiples of
    8) and widths to graph_width, where the padding rows are free, the padded chunk within GRAPH_PREFILL_POSITIONS,
    the pool within GRAPH_PREFILL_CAPACITY; as it is elsewhere, and where no graph can be captured."""
    pool = pool_with(model64, 32)
    assert graph_prefill_shape(pool, 32, 16, 512, spare=0) is None  # the CPU
    monkeypatch.setattr(slots, "graphs_supported", lambda device: True)
    assert graph_prefill_shape(pool, 32, 16, 512, spare=0) == (16, 512)
    assert graph_prefill_shape(pool, 32, 3, 528, spare=1) == (4, 640)
    assert graph_prefill_shape(pool, 32, 3, 528, spare=0) is None  # slot 35 is not free
    assert graph_prefill_shape(pool, 32, 17, 100, spare=7) == (24, 112)
    assert graph_prefill_shape(pool, 40, 2, 64, spare=6) is None  # not from the first staging slot
    assert graph_prefill_shape(pool, 32, 32, 512, spare=0) == (32, 512)
    assert graph_prefill_shape(pool, 32, 32, 528, spare=0) is None  # 32 x 640 positions
    big = pool_with(model64, 4, GRAPH_PREFILL_CAPACITY + 1)
    assert graph_prefill_shape(big, 4, 1, 64, spare=3) is None


def test_a_pool_pads_to_at_most_so_many_shapes_and_runs_other_chunks_as_they_are(model64, graph_device):
    pool = pool_with(model64, 32)
    widths = [16 * (i + 1) for i in range(GRAPH_PREFILL_SHAPES)]
    pool.padded_shapes.update((1, width) for width in widths)
    assert graph_prefill_shape(pool, 32, 1, widths[-1], spare=0) == (1, widths[-1])
    assert graph_prefill_shape(pool, 32, 1, widths[-1] + 16, spare=0) is None
    assert graph_prefill_shape(pool, 32, 2, widths[0], spare=0) is None
    open_slots(model64, run_options(model64, 0), 32, 4 * pool.capacity)  # a grown pool starts again
    assert graph_prefill_shape(pool, 32, 2, widths[0], spare=0) == (2, 16)


def padded_schedule(model, options, rows: list[list[int]], new: int) -> list[list[int]]:
    """Four prompts through a pool of 4 slots: the fourth prefilled alone into the last staging slot, then the
    first three together from the first staging slot in chunks of 11 - padded to 4 rows and 16 tokens where a
    device captures graphs (slots.graph_prefill_shape), over the fourth's slot - then all four decode; at least
    `new` tokens each, in order."""
    open_slots(model, options, 4, 256)
    fourth = prefill_alone(model, 7, rows[3], 16)
    firsts = [None] * 3
    for s in range(0, max(len(p) for p in rows[:3]), 11):
        chunk = [ChunkRow(p[s:s + 11], p[s + 11] if s + 11 < len(p) else None) for p in rows[:3]]
        got = prefill_slots(model, 4, chunk, 11, [RowSampling()] * 3 if s == 0 else None, spare=1)
        firsts = [f if f is not None else g for f, g in zip(firsts, got, strict=True)]
    move_slots(model, [4, 5, 6, 7], [0, 1, 2, 3])
    made = [[first] for first in [*firsts, fourth]]
    while min(len(m) for m in made) < new:
        for result in decode_slots(model, 4, 4):
            for row in range(4):
                made[row] += result.tokens[row]
    return [m[:new] for m in made]


@pytest.mark.parametrize("k", [0, 1])
def test_a_chunk_padded_as_a_graph_runs_it_makes_its_rows_tokens_and_leaves_its_padding_slot_alone(
        model64, k, graph_device):
    """padded_schedule's three prompts, padded to 4 rows and 16 tokens over the fourth's slot (the padded chunks run
    eagerly here, with a graph's static shapes), and the fourth decode the tokens generate() gives each alone
    (float64): neither the padding row nor the padding positions changed a state."""
    options = run_options(model64, k)
    rows, new = prompts(4, seed=11, low=20, high=40), 16
    alone = [generate(model64, [p], new, options).tokens[0] for p in rows]
    assert padded_schedule(model64, options, rows, new) == alone
    assert pool_of(model64).padded_shapes == {(4, 16)}


def test_the_prefill_warm_up_runs_its_shapes_on_scratch_states_and_leaves_the_pool_alone(model64):
    """slots.warm_up_prefill (with MTP: the head's prefill too) runs each shape and touches no slot of the pool:
    a row prefilled before it decodes the tokens generate() gives."""
    options = run_options(model64, 1)
    prompt = prompts(1, 9)[0]
    open_slots(model64, options, 2, 256)
    first = prefill_alone(model64, 2, prompt, 16)
    move_slots(model64, [2], [0])
    assert warm_up_prefill(model64, options, [(1, 16), (2, 32), (1, 48)]) == 3
    made = [first]
    while len(made) < 12:
        made += [t for r in decode_slots(model64, 1, 4) for t in r.tokens[0]]
    assert made[:12] == generate(model64, [prompt], 12).tokens[0]


def test_a_batcher_warms_its_prefill_up_where_triton_kernels_run_and_not_elsewhere(runner64, monkeypatch):
    """Where the Triton kernels run (a GPU, an NPU), the batcher runs warm_up_shapes(its budget) before its worker
    takes a request; on the CPU (PyTorch's kernels: nothing to compile or tune) it does not."""
    calls = []
    monkeypatch.setattr(runner64, "warm_up_prefill", lambda shapes: calls.append(shapes) or len(shapes))
    ContinuousBatcher(runner64, 4, prefill_tokens=512).close(30)
    assert calls == []
    monkeypatch.setattr(continuous, "runs_triton", lambda device: True)
    ContinuousBatcher(runner64, 4, prefill_tokens=512).close(30)
    assert calls == [warm_up_shapes(512)]


def test_a_new_group_waits_a_round_for_rows_arriving_just_after_it_and_prefills_with_them(runner64, monkeypatch):
    """While rows decode, a request admitted in one iteration and another arriving in the next prefill as one chunk
    of two rows (clients coming back over HTTP a few milliseconds apart), not as two; both get generate()'s tokens.
    The worker is held inside a decode call while each request is sent, so that they arrive an iteration apart."""
    batcher = ContinuousBatcher(runner64, 4, prefill_tokens=64)
    decode, prefill = runner64.decode_slots, runner64.prefill_slots
    entered, go, hold = threading.Event(), threading.Semaphore(0), threading.Event()
    chunk_rows: list[int] = []

    def held_decode(n, rounds):
        if hold.is_set():
            entered.set()
            go.acquire()
        return decode(n, rounds)

    monkeypatch.setattr(runner64, "decode_slots", held_decode)
    monkeypatch.setattr(runner64, "prefill_slots", lambda first, chunk, *rest: chunk_rows.append(len(chunk))
                        or prefill(first, chunk, *rest))
    short, a, b = prompts(3, 12, 5, 20)
    decoding = threading.Event()
    try:
        long = batcher.submit(Job([TextRequest(short, 40)], SamplingParams(), on_tokens=lambda *_: decoding.set()))
        assert decoding.wait(60)
        hold.set()
        assert entered.wait(60)
        entered.clear()
        chunk_rows.clear()
        first = batcher.submit(Job([TextRequest(a, 6)], SamplingParams()))
        go.release()  # the next iteration admits `a`; its group waits; the worker is held in the decode after
        assert entered.wait(60)
        assert [(len(g.rows), g.started) for g in batcher.groups] == [(1, False)]
        second = batcher.submit(Job([TextRequest(b, 6)], SamplingParams()))
        hold.clear()
        go.release()
        answers = [long.result(timeout=120)[0], first.result(timeout=120)[0], second.result(timeout=120)[0]]
    finally:
        hold.clear()
        go.release()
        batcher.close(30)
    assert chunk_rows == [2]
    for prompt, answer, new in zip([short, a, b], answers, [40, 6, 6], strict=True):
        assert answer.result.token_ids == generate(runner64.model, [prompt], new, runner64.options,
                                                   stop_tokens=runner64.stop_tokens).tokens[0]


@pytest.mark.parametrize("settle_s", [0.0, 2.0])
def test_an_idle_batcher_woken_by_a_request_takes_those_following_it_closely_into_its_first_prefill(
        runner64, monkeypatch, settle_s):
    """Two requests sent 50 ms apart to an idle batcher: with requests settling for up to 2 s of quiet they prefill
    as one chunk of two rows; without, the first prefills alone. Both get generate()'s tokens either way."""
    monkeypatch.setattr(continuous, "SETTLE_S", settle_s)
    monkeypatch.setattr(continuous, "SETTLE_MOST_S", 2 * settle_s)
    batcher = ContinuousBatcher(runner64, 4, prefill_tokens=64)
    prefill, chunk_rows = runner64.prefill_slots, []
    monkeypatch.setattr(runner64, "prefill_slots", lambda first, chunk, *rest: chunk_rows.append(len(chunk))
                        or prefill(first, chunk, *rest))
    a, b = prompts(2, 13, 5, 20)
    try:
        first = batcher.submit(Job([TextRequest(a, 4)], SamplingParams()))
        time.sleep(0.05)
        second = batcher.submit(Job([TextRequest(b, 4)], SamplingParams()))
        answers = [first.result(timeout=120)[0], second.result(timeout=120)[0]]
    finally:
        batcher.close(30)
    assert chunk_rows == ([2] if settle_s else [1, 1])
    for prompt, answer in zip([a, b], answers, strict=True):
        assert answer.result.token_ids == generate(runner64.model, [prompt], 4, runner64.options,
                                                   stop_tokens=runner64.stop_tokens).tokens[0]
