import pytest

from producer.protocol import SamplingParams
from worker.engine import blocks as blocks_module
from worker.engine.blocks import BlockPool
from worker.engine.sequence import Sequence


def make_seq(tokens, request_id="r", salt=b""):
    return Sequence(request_id, list(tokens), SamplingParams(max_tokens=8), cache_salt=salt)


def compute(pool, seq, num_tokens):
    """What the scheduler and runner do for one step of `num_tokens` tokens."""
    assert pool.allocate(seq, num_tokens)
    seq.num_computed_tokens += num_tokens
    pool.commit(seq, num_tokens)


def admit(pool, seq):
    hits = pool.match_prefix(seq)
    pool.take_prefix(seq, hits)
    seq.num_computed_tokens = len(hits) * pool.block_size
    compute(pool, seq, len(seq.token_ids) - seq.num_computed_tokens)
    return len(hits)


@pytest.mark.parametrize("block_size", [0, 4, 12, 512])
def test_block_size_must_be_a_power_of_two_in_range(block_size):
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(8, block_size)


def test_blocks_are_allocated_on_demand():
    pool = BlockPool(4, 16)
    seq = make_seq(range(17))
    compute(pool, seq, 16)
    assert len(seq.block_table) == 1
    compute(pool, seq, 1)  # token 17 takes the second block
    assert len(seq.block_table) == 2
    stats = pool.stats([seq])
    assert stats.tokens_stored == 17 and stats.slots_allocated == 32 and stats.kv_utilisation == 17 / 32


def test_allocation_is_all_or_nothing():
    pool = BlockPool(2, 16)
    seq = make_seq(range(40))
    assert not pool.allocate(seq, 40)
    assert seq.block_table == [] and pool.num_free_blocks == 2


def test_shared_prefix_blocks_are_freed_only_when_the_last_user_leaves():
    pool = BlockPool(16, 16)
    system = list(range(100, 132))  # two full blocks
    first, second = make_seq(system + [1, 2, 3], "a"), make_seq(system + [4, 5], "b")
    admit(pool, first)
    assert admit(pool, second) == 2
    shared = first.block_table[:2]
    assert second.block_table[:2] == shared
    assert [pool.blocks[b].ref_count for b in shared] == [2, 2]
    pool.free_sequence(first)
    assert [pool.blocks[b].ref_count for b in shared] == [1, 1]
    assert pool.stats().used == 3
    pool.free_sequence(second)
    stats = pool.stats()
    assert stats.used == 0 and stats.cached == 2 and stats.free + stats.cached == 16


def test_blocks_are_shared_within_a_salt_only():
    """The red team's prefix probe: another tenant's guess hit a cached secret (32 cached tokens
    for the right guess, 16 for the others). With the tenant as the salt, a guess hits nothing."""
    pool = BlockPool(16, 16)
    secret = list(range(100, 133))  # two full blocks and a token
    admit(pool, make_seq(secret, "a1", salt=b"team-a"))
    assert admit(pool, make_seq(secret, "b1", salt=b"team-b")) == 0
    assert admit(pool, make_seq(secret, "a2", salt=b"team-a")) == 2
    assert admit(pool, make_seq(secret, "none")) == 0, "unsalted is a namespace of its own"


def test_a_pinned_prefix_is_shared_by_every_salt_and_what_follows_it_is_not():
    pool = BlockPool(16, 16)
    system, question = list(range(16)), list(range(200, 216))
    pool.pin_prefix(system)
    admit(pool, make_seq(system + question + [1], "a1", salt=b"team-a"))
    assert admit(pool, make_seq(system + question + [1], "b1", salt=b"team-b")) == 1, "the pinned block only"
    assert admit(pool, make_seq(system + question + [1], "a2", salt=b"team-a")) == 2


def test_last_prompt_token_is_always_recomputed():
    pool = BlockPool(8, 16)
    admit(pool, make_seq(range(32), "a"))
    again = make_seq(range(32), "b")
    assert len(pool.match_prefix(again)) == 1  # not 2: the last token's logits are needed


def test_cached_free_blocks_are_reused_then_evicted_lru():
    pool = BlockPool(4, 16)
    old, recent = make_seq(range(17), "old"), make_seq(range(50, 67), "recent")
    admit(pool, old)
    admit(pool, recent)
    pool.free_sequence(old)
    pool.free_sequence(recent)
    assert pool.stats().cached == 2 and pool.stats().free == 2
    hungry = make_seq(range(900, 948), "hungry")  # needs three blocks: evicts one cached
    assert pool.allocate(hungry, 48)
    assert len(pool.match_prefix(make_seq(range(17), "x"))) == 0  # the oldest went
    assert len(pool.match_prefix(make_seq(range(50, 67), "y"))) == 1


def test_a_hash_collision_never_shares_kv(monkeypatch):
    monkeypatch.setattr(blocks_module, "chain_hash", lambda parent, tokens: b"same")
    pool = BlockPool(8, 16)
    admit(pool, make_seq(range(17), "a"))
    assert pool.match_prefix(make_seq(range(100, 117), "b")) == []


def test_pinned_prefix_survives_eviction_and_unpin_releases_it():
    pool = BlockPool(4, 16)
    system = list(range(16))
    assert pool.pin_prefix(system) == 1  # pinned before it is computed
    owner = make_seq(system + [7], "owner")
    admit(pool, owner)
    pool.free_sequence(owner)
    assert pool.stats().pinned == 1 and pool.stats().used == 1
    pool.allocate(make_seq(range(500, 548), "hungry"), 48)  # takes every other block
    assert pool.num_free_blocks == 0
    assert len(pool.match_prefix(make_seq(system + [9], "c"))) == 1
    pool.unpin_prefix(system)
    stats = pool.stats()
    assert stats.pinned == 0 and stats.cached == 1
    with pytest.raises(KeyError):
        pool.unpin_prefix(system)


def test_pins_that_share_a_head_hold_it_once_and_unpinning_one_keeps_it_for_the_other():
    pool = BlockPool(8, 16)
    head, tail_a, tail_b = list(range(16)), list(range(100, 116)), list(range(200, 216))
    pool.pin_prefix(head + tail_a)
    owner = make_seq(head + tail_a + tail_b + [7], "owner")  # computes the head and both tails' blocks
    admit(pool, owner)
    pool.free_sequence(owner)
    head_block, block_a = (pool.cached[h] for h in owner.block_hashes[:2])
    pool.pin_prefix(head + tail_a)  # the same prefix again: its blocks are pinned already
    assert (head_block.ref_count, block_a.ref_count) == (1, 1), "a pin holds one reference, however many pin it"
    pool.unpin_prefix(head + tail_a)
    assert head_block.pinned and block_a.pinned and head_block.ref_count == 1  # the other pin of it stays

    other = make_seq(head + tail_b + [7], "other")
    pool.pin_prefix(head + tail_b)
    admit(pool, other)
    pool.free_sequence(other)
    pool.unpin_prefix(head + tail_a)
    assert not block_a.pinned and block_a.ref_count == 0  # its own block goes
    assert head_block.pinned and head_block.ref_count == 1, "the head is still pinned by the other prefix"
    pool.unpin_prefix(head + tail_b)
    assert not head_block.pinned and head_block.ref_count == 0 and pool.stats().pinned == 0


def test_disabled_prefix_caching_never_hits():
    pool = BlockPool(8, 16, enable_prefix_caching=False)
    admit(pool, make_seq(range(40), "a"))
    assert pool.match_prefix(make_seq(range(40), "b")) == []
