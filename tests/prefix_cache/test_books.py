"""PrefixBooks: one account of hits, waiters, late counts, private ids and the nodes' orders."""

from __future__ import annotations

from engines.core.request import GenerationRequest
from engines.prefix_cache.books import PrefixBooks, PrefixOrders
from engines.prefix_cache.index import PrefixHit, PrefixIndex
from engines.prefix_cache.shared_prefill import PrefillSharing

TOP = 1000


def books(max_bytes: int = 1000, disk_bytes: int = 0, **sharing: float) -> PrefixBooks:
    index = PrefixIndex(max_bytes, disk_bytes=disk_bytes, min_disk_hit_tokens=1)
    return PrefixBooks(index, TOP, PrefillSharing(**sharing))


def test_private_ids_count_down_from_the_engines_top_and_below_any_claimed():
    kept = books()
    assert [kept.take_private_id() for _ in range(3)] == [TOP, TOP - 1, TOP - 2]
    kept.claim_private_id(TOP - 10)  # a node listed an entry of its own under that id
    assert kept.take_private_id() == TOP - 11
    kept.claim_private_id(TOP)  # above the next id: changes nothing
    assert kept.take_private_id() == TOP - 12


def test_an_entry_that_makes_another_redundant_orders_it_dropped_once():
    kept = books()
    kept.index_entry(1, (1, 2, 3), 100)
    assert not kept.orders_pending
    kept.index_entry(2, (1, 2, 3, 4, 5), 100)  # entry 1 is a prefix of it
    assert kept.orders_pending
    assert kept.take_orders() == PrefixOrders(evict=[1], spill=[], keep=[])
    assert not kept.take_orders()
    assert kept.lookup((1, 2, 3, 4, 5, 6)) == PrefixHit(2, 5)


def test_memory_pressure_spills_to_disk_and_says_how_many_bytes_it_freed():
    kept = books(max_bytes=1000, disk_bytes=1000)
    kept.index_entry(1, (1, 2), 300)
    kept.index_entry(2, (3, 4), 300)
    assert kept.evict(0.5) == 300
    assert kept.take_orders() == PrefixOrders(evict=[], spill=[1], keep=[])
    assert kept.lookup((1, 2, 9)) == PrefixHit(1, 2, on_disk=True)


def test_an_entry_too_big_for_the_budget_is_ordered_dropped_at_once():
    kept = books(max_bytes=100)
    kept.index_entry(7, (1, 2, 3), 500)
    assert kept.take_orders().evict == [7]
    assert kept.lookup((1, 2, 3, 4)) is None


def test_an_entry_a_pinned_sequence_will_begin_from_is_dropped_only_once_it_has_begun():
    kept = books(max_bytes=1000)
    kept.index_entry(1, (1, 2, 3), 100)
    hit = kept.lookup((1, 2, 3, 4))
    kept.pin(5, hit)
    assert kept.pinned(5) == hit and kept.pinned_uids() == [5]
    kept.evict(0.0)  # the index forgets entry 1, but uid 5 has not begun from it yet
    assert not kept.take_orders()
    kept.begun([5])
    assert kept.take_orders().evict == [1]
    assert kept.pinned(5) is None


def test_forgetting_a_pinned_sequence_frees_its_held_entry():
    kept = books(max_bytes=1000)
    kept.index_entry(1, (1, 2, 3), 100)
    kept.pin(5, kept.lookup((1, 2, 3, 4)))
    kept.index_entry(2, (1, 2, 3, 4, 5), 100)  # makes entry 1 redundant: held for uid 5
    assert not kept.take_orders()
    kept.forget([5])  # cancelled before it began
    assert kept.take_orders().evict == [1]


def test_an_unusable_entry_is_dropped_everywhere_and_its_pinned_sequences_start_cold():
    kept = books(max_bytes=1000)
    kept.index_entry(1, (1, 2, 3), 100)
    kept.index_entry(2, (7, 8, 9), 100)
    kept.pin(5, PrefixHit(1, 3))
    kept.pin(6, PrefixHit(2, 3))
    assert kept.discard([1, 1]) == [5]
    assert kept.take_orders().evict == [1]
    assert kept.pinned_uids() == [6]
    assert kept.snapshot()["disk_failures"] == 1
    assert kept.lookup((1, 2, 3, 4)) is None


def test_a_late_count_is_reported_once_and_forgotten_with_its_sequence():
    kept = books()
    kept.report_late(3, 40)
    kept.report_late(4, 0)
    assert kept.any_late
    assert kept.late_cached(3) == 40 and kept.late_cached(3) is None
    kept.forget([4])
    assert kept.late_cached(4) is None and not kept.any_late


def test_a_request_waits_for_a_prompt_being_prefilled_and_its_owner_orders_a_keep():
    kept = books(min_shared_tokens=4)
    prompt = tuple(range(1, 11))
    kept.prefilling(1, prompt)
    waiter = GenerationRequest("waiter", prompt[:8] + (99, 98), 4)
    assert kept.hold(2, waiter)
    assert kept.released() == []
    assert kept.owners_done([1, 3]) == {1}
    entry = kept.take_private_id()
    kept.order_keep(1, entry)
    assert kept.take_orders() == PrefixOrders(evict=[], spill=[], keep=[(1, entry)])
    assert kept.released({1}) == [(2, waiter)]
    assert kept.snapshot()["shared_prefills"] == 1


def test_with_the_cache_off_nothing_waits_and_nothing_is_worth_keeping():
    kept = books(max_bytes=0, min_shared_tokens=1)
    kept.prefilling(1, (1, 2, 3, 4))
    assert not kept.hold(2, GenerationRequest("waiter", (1, 2, 3, 5), 4))
    assert not kept.worth_keeping(10)
    assert books().worth_keeping(1) and not books().worth_keeping(0)


def test_entries_restored_past_the_disk_budget_are_ordered_dropped():
    kept = books(max_bytes=1000, disk_bytes=150)
    kept.restore(-1, (1, 2), 100)
    kept.restore(-2, (3, 4), 100)  # past the disk budget: the oldest goes
    assert kept.take_orders().evict == [-1]
    assert kept.snapshot()["disk_entries"] == 1


def test_clearing_forgets_every_entry_pin_and_order_and_names_the_pinned_sequences():
    kept = books()
    kept.index_entry(1, (1, 2, 3), 100)
    kept.pin(5, kept.lookup((1, 2, 3, 4)))
    kept.order_evict([9])
    assert kept.clear() == [5]
    assert not kept.orders_pending and kept.pinned_uids() == []
    assert kept.snapshot()["entries"] == 0
