"""A verify step's device work does not grow with the batch or the output length.

The verify side of a step (`SampleMatchVerifier.prepare_verify` then its call: positions,
vLLM's rules with penalties at every node, the draws, the walk, the accepted paths' KV moves)
with sampled, penalized requests, on CPU tensors standing in for the device: every dispatched
operator that is not a view (each a kernel launch on CUDA) is counted, and so is every read of
a tensor's values on the host (`tolist`, `item`, `cpu`, `numpy`: each a host sync on CUDA).
Both must be the same for 1 and 8 requests, and for 10 and 1,000 output tokens so far.
"""

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from subspec_testing.stub_verify import run_verify, sampling, verify_step

class Launches(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


class HostReads(TorchFunctionMode):
    READS = {"tolist", "item", "cpu", "numpy"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def one_step(batch: int, output_len: int):
    """One step's (launches, host reads, emitted tokens) over `batch` 7-node trees."""
    verifier, scheduled, logits = verify_step(batch)
    meta = sampling(batch, output_len, logits.shape[-1])
    with Launches() as launches, HostReads() as reads:
        out = run_verify(verifier, scheduled, logits, meta)
    return launches.ops, reads.reads, out.sampled_token_ids


def test_a_penalized_verify_steps_launches_and_syncs_do_not_grow_with_batch_or_output():
    base_ops, base_reads, base_out = one_step(batch=1, output_len=10)
    assert base_out[0, :3].tolist() == [6, 8, 1]  # the walk accepted nodes 2 and 4
    for batch, output_len in ((8, 10), (8, 1000), (1, 1000)):
        ops, reads, out = one_step(batch, output_len)
        assert (out[:, :3] == torch.tensor([6, 8, 1])).all()
        assert sorted(ops) == sorted(base_ops), (batch, output_len)
        assert reads == base_reads, (batch, output_len, reads)
    assert len(base_reads) <= 2, base_reads  # the draws, read once (and the walk's own)
