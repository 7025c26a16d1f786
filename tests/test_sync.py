"""Weight-sync pieces without Ray: bucket layout, packing, the wire protocol over a real gloo group, and the
one-gather FSDP collection (rapo_ray/sync.py, rapo_ray/learner.py). The Ray-level pushes are in test_trainer.py."""

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from rapo_ray.sync import SyncGroup, TensorSlot, pack, plan_buckets, receive_state, send_state, unpack


def test_plan_buckets_aligns_offsets_and_never_splits_a_tensor():
    entries = [("a", (3,), "float32"), ("b", (10,), "bfloat16"), ("c", (100,), "float32"), ("d", (2, 2), "int64")]
    buckets = plan_buckets(entries, bucket_bytes=256)
    # a: 12 B at 0; b: 20 B at 64 (aligned); c: 400 B does not fit after 84 -> a bucket of its own though > 256;
    # d: 32 B does not fit after c's 400 -> the next bucket
    assert buckets == [
        [TensorSlot("a", (3,), "float32", 0, 12), TensorSlot("b", (10,), "bfloat16", 64, 20)],
        [TensorSlot("c", (100,), "float32", 0, 400)],
        [TensorSlot("d", (2, 2), "int64", 0, 32)],
    ]


def test_pack_unpack_round_trip_is_bit_exact_in_every_dtype():
    torch.manual_seed(0)
    tensors = {
        "w": torch.randn(5, 3),
        "h": torch.randn(7).to(torch.bfloat16),
        "f": torch.randn(2, 2).to(torch.float16),
        "i": torch.arange(6).view(3, 2),
    }
    (bucket,) = plan_buckets([(k, tuple(v.shape), str(v.dtype)[6:]) for k, v in tensors.items()], 1 << 20)
    buf = pack(list(tensors.values()), bucket)
    assert buf.dtype == torch.uint8 and buf.numel() == bucket[-1].offset + bucket[-1].nbytes
    back = unpack(buf.clone(), bucket)
    assert all(back[k].dtype == v.dtype and torch.equal(back[k], v) for k, v in tensors.items())
    with pytest.raises(ValueError, match="w: got torch.float64"):
        pack([tensors["w"].double(), *list(tensors.values())[1:]], bucket)


def _pair(timeout_s=30.0):
    """Ranks 0 and 1 of one sync group, in this process (two gloo process groups on a loopback store)."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    groups = [None, None]

    def join(rank):
        groups[rank] = SyncGroup("127.0.0.1", store.port, "t/", rank, 2, timeout_s)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return store, groups


def test_a_push_arrives_whole_and_a_repeated_layout_is_not_resent():
    store, (sender, receiver) = _pair()
    torch.manual_seed(0)
    weights = {"a": torch.randn(300), "b": torch.randn(40, 7).to(torch.bfloat16), "c": torch.randn(2)}
    entries = [(k, tuple(v.shape), str(v.dtype)[6:]) for k, v in weights.items()]
    fetched = []

    def fetch(bucket):
        fetched.append([slot.name for slot in bucket])
        return pack([weights[slot.name] for slot in bucket], bucket)

    for version in (4, 5):
        got = {}
        t = threading.Thread(target=lambda: got.update(zip(("version", "sd"), receive_state(receiver))))
        t.start()
        stats = send_state(sender, version, entries, fetch, bucket_bytes=1024)
        t.join()
        assert got["version"] == version and all(torch.equal(got["sd"][k], v) for k, v in weights.items())
        assert stats["buckets"] == 2  # a (1,200 B) alone; b (560 B) and c together
    assert receiver.spec is not None and receiver.spec == sender.spec  # push 5 reused push 4's layout
    assert fetched == [["a"], ["b", "c"]] * 2


def test_a_sender_failing_mid_push_frees_the_receiver_at_once():
    """A failure on sync rank 0 between buckets must not leave a receiver waiting for the timeout (120 s here):
    the group is closed, the receiver raises and returns nothing."""
    store, (sender, receiver) = _pair(timeout_s=120)
    entries = [("a", (10,), "float32"), ("b", (10,), "float32")]

    def fetch(bucket):
        if bucket[0].name == "b":
            raise OSError("disk gone")
        return pack([torch.ones(10)], bucket)

    errors = []

    def receive():
        try:
            receive_state(receiver)
        except Exception as exc:  # noqa: BLE001 - inspected below
            errors.append(exc)

    t = threading.Thread(target=receive)
    t.start()
    t0 = time.perf_counter()
    with pytest.raises(OSError, match="disk gone"):
        send_state(sender, 1, entries, fetch, bucket_bytes=40)
    t.join(timeout=60)
    assert not t.is_alive() and errors and time.perf_counter() - t0 < 30


def _gather_rank(rank, world, port, shapes, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from rapo_ray.learner import gather_bucket

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = [torch.randn(*s) for s in shapes]
    sharded = [distribute_tensor(t, mesh, [Shard(0)]) for t in full]
    (bucket,) = plan_buckets([(f"t{i}", s, "bfloat16") for i, s in enumerate(shapes)], 1 << 20)
    packed = gather_bucket(sharded, bucket, rank, world)
    (plain,) = plan_buckets([("p", shapes[0], "bfloat16")], 1 << 20)
    packed_plain = gather_bucket([full[0]], plain, rank, world)
    if rank == 0:
        got = [*unpack(packed, bucket).values(), unpack(packed_plain, plain)["p"]]
        torch.save({"got": got, "want": [t.to(torch.bfloat16) for t in [*full, full[0]]]}, f"{out_dir}/gathered.pt")
    else:
        assert packed is None and packed_plain is None
    dist.destroy_process_group()


def test_gather_bucket_rebuilds_uneven_fsdp_shards_on_rank_0(tmp_path):
    """Three ranks; dim 0 of 7 (chunks 3, 3, 1), of 2 (1, 1, none) and of 9: one gather, rank 0 gets the bucket
    with each full tensor (and a plain tensor's bucket as it is), cast to the wire dtype."""
    from rapo_ray.net import free_port

    shapes = [(7, 5), (2,), (9, 2, 3)]
    tmp.start_processes(_gather_rank, args=(3, free_port(), shapes, str(tmp_path)), nprocs=3, start_method="spawn")
    blob = torch.load(tmp_path / "gathered.pt")
    assert len(blob["got"]) == 4
    assert all(g.dtype == torch.bfloat16 and torch.equal(g, w) for g, w in zip(blob["got"], blob["want"]))
