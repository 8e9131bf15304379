"""The trainer's garbage collection: its pauses timed, the heap frozen until closed (the run: test_e2e.py)."""

import gc

from hybridrl.heap import Collector


def test_collections_are_timed_and_a_frozen_heap_leaves_full_collections_nothing_old_to_scan():
    collector = Collector()
    try:
        kept = [[i] for i in range(20_000)]  # tracked objects that stay alive
        gc.collect()
        assert len(gc.get_objects(generation=2)) > len(kept)
        took = collector.metrics()
        assert 0 < took["timing/gc_longest"] <= took["timing/gc"]
        collector.reset()
        assert collector.metrics() == {"timing/gc": 0.0, "timing/gc_longest": 0.0}

        collector.freeze()
        assert gc.get_freeze_count() >= len(kept)
        assert len(gc.get_objects(generation=2)) < len(kept) // 10  # a full collection no longer scans them
        assert collector.metrics()["timing/gc"] == 0.0  # the freeze's own collection is no step's
    finally:
        collector.close()
    assert gc.get_freeze_count() == 0  # given back to the collector, which frees what the run dropped
    assert collector._heard not in gc.callbacks
