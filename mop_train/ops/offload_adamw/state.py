"""Where each parameter's optimizer state lives, and the state dict built from it (DCP-checkpointable).

Parameter i's flat range [o_i, o_i + n_i) may lie in the device-resident head [0, N_d) (moments in
`DeviceShare.moments`; masters there too, or the fp32 working weight itself), in the host buffer
[N_d, N) (`_host`, [3, N - N_d]: master, exp_avg, exp_avg_sq), or straddle N_d (head on the device,
tail on the host). The state dict holds, per parameter, "step", "exp_avg", "exp_avg_sq" and
"master" with the parameter's (local) shape, as DTensors for DTensor parameters: live views where
the state is in one place, a host copy for the straddler. Loading copies into place.
`master_view(i)` is parameter i's master in place, `value_tensor(i)` the tensor holding its value
with weights != "device" (the master, or the straddler's host mirror).
Legend: N local elements, N_d device-resident elements.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from mop_train.ops.offload_adamw.checks import check_group

ROW = {"master": 0, "exp_avg": 1, "exp_avg_sq": 2}  # rows of the [3, N - N_d] host state


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The local shard of an FSDP2 / DTensor parameter or gradient; plain tensors as they are."""
    return t._local_tensor if isinstance(t, DTensor) else t


def as_param_state(flat: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """View one parameter's state (flat, any device) with the parameter's shape (a DTensor for DTensors).

    DTensor.from_local would copy a host tensor to the mesh's device, so the wrapper is built from
    the parameter's own sharding spec with an fp32 tensor meta.
    """
    local = flat.view(local_shard(param).shape)
    if not isinstance(param, DTensor):
        return local
    meta = TensorMeta(param.shape, param.stride(), torch.float32)
    return DTensor(local, DTensorSpec(param.device_mesh, param.placements, tensor_meta=meta),
                   requires_grad=False)


class StateDictMixin:
    """OffloadStreamAdamW's state_dict / load_state_dict over its device and host pieces, and its
    masters' views (master_view, value_tensor).

    Uses the optimizer's _params, _offsets, _numels, _dev_end, _device_share, _host, _steps,
    _mirrors, param_groups, state and wait_for_writeback()."""

    def _row_pieces(self, row: int, i: int) -> list[tuple[int, torch.Tensor]]:
        """(first element in the parameter, view) of parameter i's state row: its head in the device
        share, its tail in the host buffer (one piece unless it straddles N_d)."""
        start, numel, end = self._offsets[i], self._numels[i], self._dev_end
        if numel == 0:
            return [(0, self._host[row, :0])]
        pieces = []
        head = min(numel, max(end - start, 0))
        if head:
            work = {i: local_shard(self._params[i]).detach().view(-1)}  # state, not an autograd view
            pieces.append((0, self._device_share.rows(i, 0, start, head, work)[row]))
        if head < numel:
            lo = start + head - end
            pieces.append((head, self._host[row, lo:lo + numel - head]))
        return pieces

    def _write_row(self, row: int, i: int, value: torch.Tensor) -> None:
        """Copy parameter i's flat `value` into its state row (wherever its pieces live)."""
        for first, view in self._row_pieces(row, i):  # (an aliased master copies the weight onto itself)
            view.copy_(value[first:first + view.numel()])

    def _read_row(self, row: int, i: int) -> torch.Tensor:
        """Parameter i's state row: a live view, or a host copy when it straddles N_d."""
        pieces = self._row_pieces(row, i)
        if len(pieces) == 1:
            return pieces[0][1]
        return torch.cat([view.detach().to("cpu") for _, view in pieces])

    def master_view(self, i: int) -> torch.Tensor:
        """Parameter i's fp32 master, flat: a view of the host state or of the device share."""
        pieces = self._row_pieces(ROW["master"], i)
        if len(pieces) != 1:
            raise ValueError(f"parameter {i} straddles the device share's end: its master is in two pieces; "
                             "use value_tensor(i)")
        return pieces[0][1]

    def value_tensor(self, i: int) -> torch.Tensor:
        """The fp32 tensor that holds parameter i's value with weights != "device" (working.py): its
        master, or for the one parameter straddling the device share's end a host copy of its two
        pieces, brought up to date by `wait_for_weights` (checkpoints and evaluations call it first)."""
        if len(self._row_pieces(ROW["master"], i)) == 1:
            return self.master_view(i)
        if i not in self._mirrors:
            self._mirrors[i] = self._read_row(ROW["master"], i).clone()
        return self._mirrors[i]

    def _refresh_state(self) -> None:
        """self.state[p] as torch's state_dict packs it: views (or the straddler's copies) per key."""
        for i, p in enumerate(self._params):
            self.state[p] = {"step": self._steps[i]} | {
                key: as_param_state(self._read_row(row, i), p)
                for key, row in (("exp_avg", 1), ("exp_avg_sq", 2), ("master", 0))}

    # ---- checkpointing ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        self.wait_for_writeback()
        self._refresh_state()  # FSDP2 may have swapped the local tensors that fp32 masters alias
        out = super().state_dict()
        out["state"] = {k: dict(v) for k, v in out["state"].items()}  # callers may edit entries
        return out

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Copy a state dict (ours, torch.optim.AdamW's, or DCP's) into the state's places.

        Parameters missing from state_dict["state"] start afresh; a missing "master" is taken from
        the current working weight (so a torch.optim.AdamW checkpoint can be resumed).
        """
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        saved_groups = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        saved_sizes = [len(g["params"]) for g in saved_groups]
        if saved_sizes != sizes:
            raise ValueError(f"state_dict has param groups of sizes {saved_sizes}, this optimizer "
                             f"{sizes}; build the optimizer with the same param groups")
        self.wait_for_writeback()
        i = 0
        for saved, group in zip(saved_groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            check_group(group)
            for key in saved["params"]:
                self._load_param_state(i, state_dict["state"].get(key))
                i += 1
        self._refresh_state()
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _load_param_state(self, i: int, entry) -> None:
        weight = local_shard(self._params[i]).reshape(-1)
        if entry is None:
            self._steps[i] = 0.0
            for row in (1, 2):
                for _, view in self._row_pieces(row, i):
                    view.zero_()
            self._write_row(0, i, weight)
            return
        self._steps[i] = float(entry["step"])
        for key, row in ROW.items():
            if key in entry:
                self._write_row(row, i, self._local_value(entry[key], i).reshape(-1))
            elif key == "master":
                self._write_row(row, i, weight)
            else:
                raise ValueError(f"optimizer state of parameter {i} lacks {key!r} "
                                 f"(has {sorted(entry)}); load an AdamW state dict")

    def _local_value(self, value: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's part of a saved state tensor (DTensor, local shard, or full tensor)."""
        param = self._params[i]
        local_shape = local_shard(param).shape
        if isinstance(value, DTensor):
            if isinstance(param, DTensor) and tuple(value.placements) != tuple(param.placements):
                value = value.redistribute(param.device_mesh, param.placements)
            value = value._local_tensor
        elif isinstance(param, DTensor) and value.shape == param.shape != local_shape:
            shape, offset = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements)
            value = value[tuple(slice(o, o + n) for o, n in zip(offset, shape))]
        if value.shape != local_shape:
            raise ValueError(f"saved state of shape {tuple(value.shape)} does not fit parameter {i} "
                             f"(local shape {tuple(local_shape)})")
        return value

    @torch.no_grad()
    def reset_masters_from_params(self) -> None:
        """Re-read every master from its working weight (after loading weights without optimizer state)."""
        self.drop_staged()
        self.wait_for_writeback()
        for i, p in enumerate(self._params):
            self._write_row(0, i, local_shard(p).reshape(-1))
