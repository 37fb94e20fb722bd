"""The shard-first merge plan, without processes: a pack's vision units (whole images, single
video temporal groups) are balanced over ranks by the documented cost model, and routing every
rank's encoded rows by the plan (the all-to-all done by hand here) puts each feature row at its
own placeholder, on the rank whose shard holds it, when images and videos interleave; an image
shown twice (a preference pair's prompt image) is encoded once and serves both uses."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vlmcp.model.vision_routing import (
    IMAGE_PIXELS,
    VIDEO_PIXELS,
    UnitRouting,
    VisionUnits,
    assign_units,
    cost_alpha,
    unit_cost,
)

MERGE = 2
ALPHA = 128


def test_unit_cost_is_quadratic_in_patches_plus_alpha_times_patches():
    assert unit_cost(16, 128) == 16 * 16 + 128 * 16
    assert unit_cost(0, 128) == 0
    assert cost_alpha(SimpleNamespace(hidden_size=1152, intermediate_size=4304)) == 6608


def test_largest_unit_first_to_the_least_loaded_rank():
    assert assign_units([16, 64, 4, 4, 8], 2) == (1, 0, 1, 1, 1)
    assert assign_units([10, 10, 10, 10], 2) == (0, 1, 0, 1)
    assert assign_units([5, 3, 3, 2], 3) == (0, 1, 2, 1)


def test_balancing_the_cost_beats_balancing_patches():
    """Units of 60, 50, 20, 20, 20 patches on two ranks, alpha 0: balancing patches (largest
    first) would pair 60+20 against 50+20+20, a cost of 4000 on the busier rank; the cost model
    keeps the 60-patch unit alone (3600 against 3700)."""
    patches = [60, 50, 20, 20, 20]
    owners = assign_units([unit_cost(p, 0) for p in patches], 2)
    assert owners == (0, 1, 1, 1, 1)
    loads = [sum(unit_cost(p, 0) for p, o in zip(patches, owners) if o == r) for r in range(2)]
    assert max(loads) == 3700 < 4000
    assert assign_units(patches, 2) == (0, 1, 1, 0, 1)


def test_a_long_videos_groups_spread_over_every_rank():
    """64 frames = 32 equal groups next to a small image: every rank gets 8 groups."""
    costs = [unit_cost(4, ALPHA)] + [unit_cost(256, ALPHA)] * 32
    owners = assign_units(costs, 4)
    assert sorted(owners[1:].count(r) for r in range(4)) == [8, 8, 8, 8]


def test_a_unit_larger_than_all_others_together_gets_a_rank_of_its_own():
    owners = assign_units([4, 4, 100, 4, 4, 4], 2)
    assert owners[2] == 0
    assert all(owner == 1 for i, owner in enumerate(owners) if i != 2)


def test_more_ranks_than_units_leaves_ranks_without_units():
    assert assign_units([4, 8], 4) == (1, 0)
    assert assign_units([], 3) == ()


def _units(image_grids, video_grids, image_positions, video_positions) -> VisionUnits:
    return VisionUnits.of_pack(torch.tensor(image_grids).reshape(-1, 3),
                               torch.tensor(video_grids).reshape(-1, 3) if video_grids else None,
                               torch.tensor(image_positions, dtype=torch.long),
                               torch.tensor(video_positions, dtype=torch.long), MERGE)


def test_a_video_becomes_one_unit_per_temporal_group_after_the_images():
    units = _units([(1, 2, 2)], [(3, 2, 4), (1, 4, 4)], [5], [*range(10, 12), *range(14, 16),
                                                            *range(18, 20), *range(22, 26)])
    assert units.grids.tolist() == [[1, 2, 2], [1, 2, 4], [1, 2, 4], [1, 2, 4], [1, 4, 4]]
    assert units.pixel_ranges == ((IMAGE_PIXELS, 0, 4), (VIDEO_PIXELS, 0, 8), (VIDEO_PIXELS, 8, 16),
                                  (VIDEO_PIXELS, 16, 24), (VIDEO_PIXELS, 24, 40))
    assert units.rows.tolist() == [1, 2, 2, 2, 4]


def _feature_rows(units: VisionUnits) -> list[int]:
    """The encoded feature row each placeholder (in `units.positions` order) needs: feature row g
    (unit order: images first, then video groups) is the number g."""
    starts = [0, *torch.cumsum(units.rows, 0).tolist()]
    return [starts[u] + w for u, w in zip(units.row_unit.tolist(), units.row_within.tolist())]


def _route(units: VisionUnits, local_len: int, size: int):
    """Per rank: the feature rows it ends up with, in its shard's placeholder order, when every
    rank encodes its own units and the rows travel as the plans say (see `_feature_rows`)."""
    plans = [UnitRouting.build(units, local_len, size, r, ALPHA) for r in range(size)]
    starts = [0, *torch.cumsum(units.rows, 0).tolist()]
    sent = []
    for plan in plans:
        encoded = [g for u in plan.units for g in range(starts[u], starts[u + 1])]
        ordered = [encoded[k] for k in plan.send_index.tolist()]
        assert len(plan.send_counts) == size and sum(plan.send_counts) == len(ordered)
        chunks, start = [], 0
        for count in plan.send_counts:
            chunks.append(ordered[start : start + count])
            start += count
        sent.append(chunks)
    received = []
    for r, plan in enumerate(plans):
        arrived = [row for s in range(size) for row in sent[s][r]]
        assert [len(sent[s][r]) for s in range(size)] == list(plan.recv_counts)
        received.append([arrived[k] for k in plan.recv_order.tolist()])
    return plans, received


@pytest.mark.parametrize(
    "image_grids, video_grids, image_positions, video_positions, local_len, size",
    [
        # one image straddling the edge of ranks 0 and 1, the other inside rank 0
        ([(1, 4, 4), (1, 4, 8)], [], [*range(4, 8), *range(25, 33)], [], 26, 2),
        # a 16-row image over three ranks, two small images on the last one
        ([(1, 8, 8), (1, 2, 2), (1, 2, 2)], [], [*range(3, 19), 20, 22], [], 8, 3),
        # text-free shard: rank 3 holds no placeholder and encodes no unit
        ([(1, 8, 8), (1, 2, 2), (1, 2, 2)], [], [*range(4, 20), 28, 31], [], 11, 4),
        # a video's groups before, between and after two images, placeholders over three ranks
        ([(1, 2, 2), (1, 4, 4)], [(3, 4, 4)], [12, *range(30, 34)],
         [*range(2, 6), *range(20, 24), *range(40, 44)], 16, 3),
        # two videos of different sizes interleaved with an image, a group straddling each edge
        ([(1, 4, 2)], [(2, 2, 4), (3, 4, 4)], [*range(8, 10)],
         [3, 4, 6, 7, *range(12, 16), *range(18, 22), *range(23, 27)], 7, 4),
    ],
    ids=["p2_straddle", "p3_over_three_ranks", "p4_idle_rank", "p3_video_around_images",
         "p4_two_videos_straddle_every_edge"],
)
def test_routed_rows_land_on_their_own_placeholders(image_grids, video_grids, image_positions,
                                                    video_positions, local_len, size):
    units = _units(image_grids, video_grids, image_positions, video_positions)
    plans, received = _route(units, local_len, size)
    positions, needed = units.positions.tolist(), _feature_rows(units)
    for r in range(size):
        expected = [g for pos, g in sorted(zip(positions, needed)) if pos // local_len == r]
        assert received[r] == expected
    assert sorted(u for plan in plans for u in plan.units) == list(range(len(units)))


def test_every_rank_computes_the_same_owners():
    units = _units([(1, 4, 4), (1, 2, 2)], [(2, 4, 8)], [*range(2, 6), 9],
                   [*range(12, 20), *range(22, 30)])
    owners = {UnitRouting.build(units, 11, 3, r, ALPHA).owners for r in range(3)}
    assert owners == {(2, 2, 0, 1)}


def test_placeholders_that_disagree_with_the_units_or_the_shards_are_an_error():
    with pytest.raises(ValueError, match="5 image placeholder tokens but the images give 4 features"):
        _units([(1, 4, 4)], [], list(range(5)), [])
    with pytest.raises(ValueError, match="3 video placeholder tokens but the videos give 4 features"):
        _units([], [(2, 2, 4)], [], [1, 2, 3])
    with pytest.raises(ValueError, match="placeholder at position 8 lies beyond the 2 shards of 4 tokens"):
        UnitRouting.build(_units([(1, 4, 4)], [], list(range(5, 9)), []), 4, 2, 0, ALPHA)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_an_image_shown_twice_is_encoded_once_and_its_rows_reach_both_uses(size):
    """A pair's prompt image (4 rows) shown by both halves, another image once: the uses' rows,
    routed from the one encoding of each distinct image, land on every placeholder in order."""
    positions = [*range(2, 6), 9, 10, *range(14, 18)]
    units = VisionUnits.of_pack(torch.tensor([(1, 4, 4), (1, 2, 4)]), None,
                                torch.tensor(positions), torch.zeros(0, dtype=torch.long), MERGE,
                                image_index=torch.tensor([0, 1, 0]))
    assert len(units) == 2 and units.rows.tolist() == [4, 2]
    local_len = -(-19 // size)
    plans, received = _route(units, local_len, size)
    assert sorted(u for plan in plans for u in plan.units) == [0, 1]
    # the feature row each placeholder must get: image 0's rows, image 1's, image 0's again
    wanted = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    for r in range(size):
        assert received[r] == [w for w, pos in zip(wanted, positions) if pos // local_len == r]


@pytest.mark.parametrize("vision_mode", ["split", "replicated"])
def test_a_pack_that_holds_a_shown_twice_image_once_embeds_like_one_with_two_copies(vision_mode):
    from tests.helpers.parity import assert_within_fp32_error, build_model, float64_reference
    from vlmcp.bench.inputs import synthetic_pairs
    from vlmcp.model.merge import merge_embeddings, shard_first_embeddings
    from vlmcp.parallel.shard import ShardPlan

    model = build_model()
    config = model.config
    shared = synthetic_pairs(1024, 2, config, images=3)
    twice = synthetic_pairs(1024, 2, config, images=3, shared=False)
    assert shared.image_index is not None and twice.image_index is None
    ids = (config.image_token_id, config.video_token_id)

    def embeddings(model, batch):
        """[S, H] the pack's input embeddings, image features merged."""
        embed, vision = model.model.language_model.embed_tokens, model.model.visual
        with torch.no_grad():
            if vision_mode == "split":
                return shard_first_embeddings(embed, vision, batch, ShardPlan.build(batch.seq_lens),
                                              *ids, False)
            return merge_embeddings(embed, vision, batch, *ids, False)

    # the encoder sees a different number of rows in the two packs, so its sums may round
    # differently: both are held to the float64 embeddings with fp32's own error
    once, copies = embeddings(model, shared), embeddings(model, twice)
    exact = float64_reference(embeddings, model, twice)
    assert_within_fp32_error(once, copies, exact, name="shared image encoded once")
