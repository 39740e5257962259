"""The sampler: per-row parameters, (seed, position) reproducibility, filters, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from producer.protocol import SamplingParams
from worker.engine import kernels
from worker.engine.sampler import (SampleRequest, _top_k_top_p, apply_penalties, argmax, mix_seed, sample,
                                   sample_on_device)

VOCAB = 64


def request(position: int = 10, prompt=(), output=(), seed: int | None = None, **params) -> SampleRequest:
    return SampleRequest(SamplingParams(**params), list(prompt), list(output), position, seed)


def random_logits(rows: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


def test_each_row_is_sampled_by_its_own_params_in_either_order():
    # The classic bug: row 0's params applied to the whole batch. A greedy row and a hot
    # unfiltered row must stay themselves whichever comes first.
    hot_tokens = set()
    for position in range(100):
        logits = random_logits(2, seed=position)
        greedy_first = sample(logits, [request(position, temperature=0.0, seed=1),
                                       request(position, temperature=1.5, top_k=0, seed=1)])
        hot_first = sample(logits.flip(0), [request(position, temperature=1.5, top_k=0, seed=1),
                                            request(position, temperature=0.0, seed=1)])
        assert greedy_first.token_ids[0] == int(logits[0].argmax())
        assert hot_first.token_ids[1] == int(logits[0].argmax())
        assert greedy_first.token_ids[1] == hot_first.token_ids[0]  # same seed and position
        hot_tokens.add(greedy_first.token_ids[1] != int(logits[1].argmax()))
    assert hot_tokens == {True, False}  # the hot row really samples: not always its argmax


def test_per_row_top_k_is_not_shared():
    logits = torch.zeros(2, VOCAB)  # flat: only top_k decides what can come out
    logits[:, :2] = 0.5
    narrow, wide = set(), set()
    for position in range(200):
        out = sample(logits, [request(position, top_k=2, seed=3), request(position, top_k=0, seed=4)])
        narrow.add(out.token_ids[0])
        wide.add(out.token_ids[1])
    assert narrow == {0, 1}
    assert len(wide) > 30


def test_seeded_tokens_are_the_same_alone_and_in_any_batch():
    mine = dict(temperature=0.9, top_p=0.95, seed=1234)
    strangers = [request(temperature=1.3, top_k=5, seed=99), request(temperature=0.0),
                 request(temperature=1.0), request(temperature=0.7, min_p=0.1, seed=5)]
    for position in range(40):
        row = random_logits(1, seed=1000 + position)
        alone = sample(row, [request(position, **mine)]).token_ids[0]
        for slot in range(len(strangers) + 1):
            batch = strangers[:slot] + [request(position, **mine)] + strangers[slot:]
            others = random_logits(len(batch), seed=position + slot)
            others[slot] = row[0]
            assert sample(others, batch).token_ids[slot] == alone


def test_seed_given_on_the_request_overrides_params_and_positions_draw_anew():
    logits = torch.zeros(1, VOCAB)
    via_params = [sample(logits, [SampleRequest(SamplingParams(seed=7), [], [], p)]).token_ids[0]
                  for p in range(30)]
    via_request = [sample(logits, [SampleRequest(SamplingParams(seed=8), [], [], p, seed=7)]).token_ids[0]
                   for p in range(30)]
    assert via_params == via_request
    assert len(set(via_params)) > 10  # each position gets its own draw
    # Position defaults to len(prompt) + len(output): a resumed request lands on the same draw.
    resumed = SampleRequest(SamplingParams(seed=7), [5, 6, 7], [8, 9])
    assert sample(logits, [resumed]).token_ids == [via_params[5]]
    assert mix_seed(7, 5) != mix_seed(7, 6) != mix_seed(8, 5)


def test_unseeded_rows_sample_too():
    logits = torch.zeros(8, VOCAB)
    tokens = sample(logits, [request(p) for p in range(8)]).token_ids
    assert all(0 <= t < VOCAB for t in tokens)


@pytest.mark.parametrize("filters", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_extreme_filters_equal_greedy(filters):
    # (Exact ties at the top are the one exception: which tied token wins is unspecified.)
    logits = random_logits(32, seed=5)
    out = sample(logits, [request(p, temperature=1.7, seed=p, **filters) for p in range(32)])
    assert out.token_ids == logits.argmax(dim=1).tolist()


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    seen = {p: set() for p in (0.5, 0.6, 0.85)}
    for position in range(300):
        for p in seen:
            seen[p].add(sample(logits, [request(position, top_p=p, seed=1)]).token_ids[0])
    assert seen == {0.5: {0}, 0.6: {0, 1}, 0.85: {0, 1, 2}}


def test_head_search_matches_a_full_sort():
    # Only a head of each row is sorted, grown for flat rows: the kept sets must still be
    # exactly those of the textbook full-sort definition (top-p within the top-k set).
    vocab = 3000
    generator = torch.Generator().manual_seed(0)
    scales = [0.3, 1.0, 3.0, 8.0] * 4  # flat rows need a head of thousands, peaky ones a few
    logits = torch.stack([torch.randn(vocab, generator=generator) * s for s in scales])
    probs = logits.softmax(dim=1)
    top_k = [k or vocab for k in [0, 0, 0, 0, 1, 5, 100, 2000, 0, 7, 70, 700, 0, 0, 300, 1]]
    top_p = [0.9, 0.99, 0.5, 0.2, 1.0, 1.0, 0.9, 0.95, 0.999, 0.6, 0.8, 0.97, 0.7, 0.3, 1.0, 0.1]
    kept = _top_k_top_p(probs, top_k, top_p)
    for row in range(len(scales)):
        ordered, ids = probs[row].sort(descending=True)
        ordered, ids = ordered[: top_k[row]], ids[: top_k[row]]
        renormalised = ordered / ordered.sum()
        keep = renormalised.cumsum(0) - renormalised < top_p[row] if top_p[row] < 1 else slice(None)
        assert set(kept[row].nonzero().squeeze(1).tolist()) == set(ids[keep].tolist()), row
        torch.testing.assert_close(kept[row][ids[keep]], probs[row][ids[keep]])
    # An accelerator sorts the whole vocabulary at once: the same sets.
    torch.testing.assert_close(_top_k_top_p(probs, top_k, top_p, size=vocab), kept)


def test_sampling_on_a_device_never_reads_a_value_back():
    # Meta tensors hold no data: any operation that needs a device value on the host (.item(),
    # bool(), .tolist(), nonzero, unique) raises on them. Every kind of row but a seeded one (a
    # per-row generator, which no device sync involves, does not exist on meta) samples there.
    rows = [request(temperature=0.0), request(temperature=0.8, top_k=5), request(temperature=1.0, top_p=0.9),
            request(temperature=1.0, min_p=0.1), request(temperature=0.7, top_k=20, top_p=0.5, logprobs=3),
            request(prompt=[1, 2], output=[3], repetition_penalty=1.2, presence_penalty=0.5, logprobs=0)]
    sampled = sample_on_device(torch.empty(len(rows), VOCAB, device="meta"), rows)
    assert sampled.tokens.device.type == "meta" and sampled.tokens.shape == (len(rows),)
    assert sampled.wants_logprobs == [4, 5] and sampled.top_logprobs[0].shape == (2, 3)


def test_min_p_filters_tokens_below_a_share_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))  # min_p 0.5 -> threshold 0.25
    tokens = {sample(logits, [request(p, min_p=0.5, seed=2)]).token_ids[0] for p in range(300)}
    assert tokens == {0, 1}


def test_penalties_change_exactly_the_right_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]] * 3)
    rows = [
        # repetition over prompt + output (HF): positive / p, negative * p
        request(prompt=[0, 1], output=[2, 2], repetition_penalty=2.0),
        # presence and frequency over output only: prompt token 5 is untouched
        request(prompt=[5], output=[3, 3, 3, 1], presence_penalty=0.5, frequency_penalty=0.25),
        request(prompt=[0], output=[1]),  # neutral row stays as it was
    ]
    apply_penalties(logits, rows)
    expected = torch.tensor([
        [1.0, -2.0, 0.25, 3.0, -2.0, 1.0],
        [2.0, -1.0 - 0.5 - 0.25, 0.5, 3.0 - 0.5 - 0.75, -2.0, 1.0],
        [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
    ])
    torch.testing.assert_close(logits, expected)


def test_penalties_steer_greedy_and_do_not_touch_the_callers_logits():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    before = logits.clone()
    assert sample(logits, [request(output=[0], temperature=0.0, frequency_penalty=1.0)]).token_ids == [1]
    assert sample(logits, [request(temperature=0.0)]).token_ids == [0]
    assert torch.equal(logits, before)


NAN, INF = float("nan"), float("inf")


# Widths about a vector (16 lanes with AVX-512, 8 with AVX2) and four of them (the kernel's chains), with tails.
@pytest.mark.parametrize("rows, width", [(1, 1), (3, 15), (5, 16), (7, 17), (2, 63), (4, 64), (6, 65), (9, 1000),
                                         (64, 49152)])
def test_the_cpu_argmax_is_torchs_first_index_of_each_rows_max(rows, width):
    if kernels.native() is None:
        pytest.fail("the native kernels did not build")
    generator = torch.Generator().manual_seed(width)
    for logits in (torch.randn(rows, width, generator=generator),
                   torch.randint(-2, 2, (rows, width), generator=generator).float()):  # ties everywhere
        assert torch.equal(kernels.argmax_rows(logits), logits.max(dim=1).indices)
        assert torch.equal(argmax(logits), logits.max(dim=1).indices)


def test_the_cpu_argmax_takes_a_rows_first_nan_and_infinities_as_torch_does():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    logits[1, 50] = logits[1, 70] = NAN  # two NaNs: the first counts
    logits[2, 99] = NAN  # in the tail past the vectors
    logits[3, 0] = NAN
    logits[4] = -INF  # all -inf: index 0
    logits[5, 3] = logits[5, 90] = INF
    logits[6] = NAN
    logits[7, 64:] = 10.0  # the max first seen past the first vectors, then repeated
    assert kernels.argmax_rows(logits).tolist() == logits.max(dim=1).indices.tolist() == [
        int(logits[0].argmax()), 50, 99, 0, 0, 3, 0, 64]


def test_the_cpu_argmax_takes_rows_past_the_float_lanes_exact_indices():
    logits = torch.zeros(1, 2**24 + 5)  # indices past 2^24 are not exact in float lanes: scanned one by one
    logits[0, 2**24 + 3] = logits[0, 2**24 + 4] = 1.0
    assert kernels.argmax_rows(logits).tolist() == logits.max(dim=1).indices.tolist() == [2**24 + 3]


def test_a_greedy_batch_without_penalties_samples_from_the_logits_as_they_are():
    logits = random_logits(4)
    before = logits.clone()
    assert sample(logits, [request(temperature=0.0)] * 4).token_ids == logits.max(dim=1).indices.tolist()
    assert torch.equal(logits, before)


def test_logprobs_are_the_raw_log_softmax():
    logits = random_logits(4, seed=9)
    rows = [request(0, temperature=0.0, logprobs=3), request(1, temperature=0.5, seed=1, logprobs=5,
                                                             repetition_penalty=2.0, output=[1, 2]),
            request(2, logprobs=0, seed=2), request(3, seed=3)]
    out = sample(logits, rows)
    reference = logits.log_softmax(dim=1)
    for i, n in enumerate([3, 5, 0]):
        assert out.logprobs[i] == pytest.approx(float(reference[i, out.token_ids[i]]), abs=1e-5)
        values, ids = reference[i].topk(n) if n else (torch.tensor([]), torch.tensor([]))
        assert [t for t, _ in out.top_logprobs[i]] == ids.tolist()
        assert [v for _, v in out.top_logprobs[i]] == pytest.approx(values.tolist(), abs=1e-5)
    assert out.top_logprobs[2] == [] and out.logprobs[3] is None and out.top_logprobs[3] is None


def test_reduced_precision_logits_are_accepted():
    logits = random_logits(3, seed=4).to(torch.bfloat16)
    out = sample(logits, [request(0, temperature=0.0), request(1, seed=1), request(2, logprobs=1)])
    assert out.token_ids[0] == int(logits[0].float().argmax())
    assert math.isfinite(out.logprobs[2])


def test_rows_must_match_requests():
    with pytest.raises(ValueError, match="do not match"):
        sample(torch.zeros(2, VOCAB), [request()])


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_follows_the_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    draws = 4000
    out = sample(logits.expand(draws, 4), [request(p, temperature=temperature, seed=11) for p in range(draws)])
    frequency = torch.bincount(torch.tensor(out.token_ids), minlength=4).float() / draws
    expected = (logits / temperature).softmax(dim=0)
    assert torch.allclose(frequency, expected, atol=0.03), (frequency, expected)
