"""The shard-first merge plan, without processes: images are balanced over ranks by patch count,
and routing every rank's encoded rows by the plan's counts (the all-to-all done by hand here)
puts each image feature row at its own placeholder, on the rank whose shard holds it; an image
shown twice (a preference pair's prompt image) is encoded once and serves both uses, and a pack
that holds it once embeds exactly like one that holds two copies (split and replicated vision)."""

from __future__ import annotations

import pytest
import torch

from vlmcp.model.image_routing import ImageRouting, assign_images

MERGE = 2


def test_largest_image_first_to_the_least_loaded_rank():
    assert assign_images([16, 64, 4, 4, 8], 2) == (1, 0, 1, 1, 1)
    assert assign_images([10, 10, 10, 10], 2) == (0, 1, 0, 1)
    assert assign_images([5, 3, 3, 2], 3) == (0, 1, 2, 1)


def test_an_image_larger_than_all_others_together_gets_a_rank_of_its_own():
    owners = assign_images([4, 4, 100, 4, 4, 4], 2)
    assert owners[2] == 0
    assert all(owner == 1 for i, owner in enumerate(owners) if i != 2)


def test_more_ranks_than_images_leaves_ranks_without_images():
    assert assign_images([4, 8], 4) == (1, 0)
    assert assign_images([], 3) == ()


def _route(grids: list[tuple[int, int, int]], positions: list[int], local_len: int, size: int):
    """Per rank: the feature rows it ends up with, in its shard's placeholder order, when every
    rank encodes its own images and the rows travel as the plans say. Feature row g (global
    placeholder order) is the number g."""
    plans = [
        ImageRouting.build(torch.tensor(grids), torch.tensor(positions), local_len, size, r, MERGE)
        for r in range(size)
    ]
    rows_per_image = [t * h * w // MERGE**2 for t, h, w in grids]
    first_row = [sum(rows_per_image[:i]) for i in range(len(grids))]
    sent = []
    for plan in plans:
        encoded = [first_row[i] + j for i in plan.images for j in range(rows_per_image[i])]
        assert len(plan.send_counts) == size and sum(plan.send_counts) == len(encoded)
        chunks, start = [], 0
        for count in plan.send_counts:
            chunks.append(encoded[start : start + count])
            start += count
        sent.append(chunks)
    received = []
    for r, plan in enumerate(plans):
        arrived = [row for s in range(size) for row in sent[s][r]]
        assert [len(sent[s][r]) for s in range(size)] == list(plan.recv_counts)
        received.append([arrived[k] for k in plan.recv_order.tolist()])
    return plans, received


@pytest.mark.parametrize(
    "grids, positions, local_len, size",
    [
        # one image straddling the edge of ranks 0 and 1, the other inside rank 0
        ([(1, 4, 4), (1, 4, 8)], [*range(4, 8), *range(25, 33)], 26, 2),
        # a 16-row image over three ranks, two small images on the last one
        ([(1, 8, 8), (1, 2, 2), (1, 2, 2)], [*range(3, 19), 20, 22], 8, 3),
        # text-free shard: rank 3 holds no placeholder and encodes no image
        ([(1, 8, 8), (1, 2, 2), (1, 2, 2)], [*range(4, 20), 28, 31], 11, 4),
    ],
    ids=["p2_straddle", "p3_over_three_ranks", "p4_idle_rank"],
)
def test_routed_rows_land_on_their_own_placeholders(grids, positions, local_len, size):
    plans, received = _route(grids, positions, local_len, size)
    for r in range(size):
        expected = [g for g, pos in enumerate(positions) if pos // local_len == r]
        assert received[r] == expected
    patches = [t * h * w for t, h, w in grids]
    assert sorted(i for plan in plans for i in plan.images) == list(range(len(grids)))
    for plan in plans:
        for i, (a, b) in zip(plan.images, plan.patch_ranges):
            assert (a, b) == (sum(patches[:i]), sum(patches[: i + 1]))


def test_every_rank_computes_the_same_owners():
    grids, positions = [(1, 4, 4), (1, 2, 2), (1, 4, 8)], [*range(2, 6), 9, *range(12, 20)]
    owners = {ImageRouting.build(torch.tensor(grids), torch.tensor(positions), 7, 3, r, MERGE).owners for r in range(3)}
    assert owners == {(1, 2, 0)}


def test_placeholders_that_disagree_with_the_images_or_the_shards_are_an_error():
    with pytest.raises(ValueError, match="5 image placeholder tokens but the images give 4 features"):
        ImageRouting.build(torch.tensor([(1, 4, 4)]), torch.arange(5), 4, 2, 0, MERGE)
    with pytest.raises(ValueError, match="placeholder at position 8 lies beyond the 2 shards of 4 tokens"):
        ImageRouting.build(torch.tensor([(1, 4, 4)]), torch.arange(5, 9), 4, 2, 0, MERGE)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_an_image_shown_twice_is_encoded_once_and_its_rows_reach_both_uses(size):
    """A pair's prompt image (4 rows) shown by both halves, another image once: the uses' rows,
    routed from the one encoding of each distinct image, land on every placeholder in order."""
    grids, image_index = [(1, 4, 4), (1, 2, 4)], [0, 1, 0]
    positions = [*range(2, 6), 9, 10, *range(14, 18)]
    local_len = -(-19 // size)
    rows = [4, 2]
    distinct_first = [0, 4]
    plans = [ImageRouting.build(torch.tensor(grids), torch.tensor(positions), local_len, size, r,
                                MERGE, torch.tensor(image_index)) for r in range(size)]
    assert sorted(i for plan in plans for i in plan.images) == [0, 1]
    sent = []
    for plan in plans:
        encoded = [distinct_first[i] + j for i in plan.images for j in range(rows[i])]
        order = plan.send_index.tolist() if plan.send_index is not None else range(len(encoded))
        out = [encoded[k] for k in order]
        chunks, start = [], 0
        for count in plan.send_counts:
            chunks.append(out[start:start + count])
            start += count
        sent.append(chunks)
    # the feature row each placeholder must get: image 0's rows, image 1's, image 0's again
    wanted = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3]
    for r, plan in enumerate(plans):
        arrived = [row for s in range(size) for row in sent[s][r]]
        received = [arrived[k] for k in plan.recv_order.tolist()]
        assert received == [w for w, pos in zip(wanted, positions) if pos // local_len == r]


@pytest.mark.parametrize("vision_mode", ["split", "replicated"])
def test_a_pack_that_holds_a_shown_twice_image_once_embeds_like_one_with_two_copies(vision_mode):
    from tests.helpers.parity import build_model
    from vlmcp.bench.inputs import synthetic_pairs
    from vlmcp.model.merge import merge_embeddings, shard_first_embeddings
    from vlmcp.parallel.shard import ShardPlan

    model = build_model()
    config = model.config
    shared = synthetic_pairs(1024, 2, config, images=3)
    twice = synthetic_pairs(1024, 2, config, images=3, shared=False)
    assert shared.image_index is not None and twice.image_index is None
    embed, vision = model.model.language_model.embed_tokens, model.model.visual
    with torch.no_grad():
        if vision_mode == "split":
            embeds = [shard_first_embeddings(embed, vision, batch, ShardPlan.build(batch.seq_lens),
                                             config.image_token_id, False)
                      for batch in (shared, twice)]
        else:
            embeds = [merge_embeddings(embed, vision, batch, config.image_token_id, False)
                      for batch in (shared, twice)]
    assert torch.allclose(embeds[0], embeds[1], rtol=0, atol=1e-6)
