"""How head-wise presses hand their selection to kvpress: ``module.masked_key_indices``."""

import torch


def set_masked_key_indices(module, keep: torch.Tensor, n_pruned: int) -> None:
    """
    Record the entries ``keep`` (``(B, H_kv, T)`` bool) leaves out as kvpress's ``masked_key_indices``.

    Every batch row leaves out exactly ``n_pruned`` entries (head-wise presses have a fixed total budget per row,
    known on the host): a stable sort puts them (False) first, so the indices are found without a host sync.
    """
    bsz, num_kv_heads, k_len = keep.shape
    flat = keep.reshape(bsz, -1).to(torch.int8).argsort(dim=-1, stable=True)[:, :n_pruned].reshape(-1)
    batch_indices = torch.arange(bsz, device=keep.device).repeat_interleave(n_pruned)
    module.masked_key_indices = (batch_indices, flat // k_len, flat % k_len)
