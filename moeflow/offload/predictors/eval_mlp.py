"""The learned predictors' small eval-mode networks run as direct torch calls (their runtime call):
:class:`EvalSequential` (DuoServe's and ProMoE's MLPs) and :class:`EvalEncoder` (ExpertFlow's path encoder).

Each calls the kernels the modules themselves would call, with the same arguments in the same order, so the
output is bitwise the module's; what goes is the per-module Python (hooks, ``__getattr__``, argument
canonicalisation, the transformer layers' fast-path checks, which walk every submodule on every call).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.modules import module as _module


class EvalSequential:
    """An eval-mode ``nn.Sequential`` of Linear / BatchNorm1d / ReLU / Dropout run as direct torch calls.

    Bitwise the module's own output (the same kernels, in the same order; Dropout is the identity in eval
    mode), without the per-module call overhead (hooks, ``__getattr__``, BatchNorm's argument logic: ~2-4 us a
    module on a small CPU, 26 modules in DuoServe's ExpertMLP), and under ``no_grad`` only when grad is on:

    * Linear: ``addmm(b, x, W.t())``, what ``linear`` itself calls for a 2-d input with a bias (W.t() made once);
    * BatchNorm1d on the CPU: the kernel computes ``x * alpha + beta`` per channel with alpha and beta worked out
      from the statistics on every call; they are worked out once here (:func:`cpu_batch_norm_affine`, checked
      bit for bit against the kernel when planned, else the kernel itself) and applied with one ``addcmul``.
      On a GPU ``torch.batch_norm`` as the module calls it (cuDNN);
    * ReLU in place on the intermediates this runner made (never on the caller's input).

    The plan is made on first use and dropped by :meth:`reset` (after ``.to``, which replaces the tensors, or an
    in-place change of the parameters), by ``load_state_dict`` and by any call in training mode (an optimizer
    may change the parameters after it). Any other module, or a module in training mode, runs the module itself.
    """

    def __init__(self, seq: nn.Sequential) -> None:
        self.seq = seq
        self._steps: list[tuple] | None = None
        seq.register_load_state_dict_post_hook(self._loaded)

    def _loaded(self, module: nn.Module, incompatible_keys) -> None:
        self._steps = None

    def reset(self) -> None:
        self._steps = None

    def _plan(self) -> list[tuple] | None:
        steps: list[tuple] = []
        for m in self.seq:
            if type(m) is nn.Linear:
                if m.bias is not None:
                    steps.append(("addmm", m.bias, m.weight.t()))
                else:
                    steps.append(("linear", m.weight, None))
            elif type(m) is nn.BatchNorm1d and m.track_running_stats and m.running_mean is not None:
                affine = cpu_batch_norm_affine(m) if m.running_mean.device.type == "cpu" else None
                if affine is not None:
                    steps.append(("affine", *affine))
                else:
                    steps.append(("bn", m.weight, m.bias, m.running_mean, m.running_var, m.eps))
            elif type(m) is nn.ReLU:
                steps.append(("relu_" if steps else "relu",))
            elif type(m) is nn.Dropout:
                continue
            else:
                return None
        return steps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.seq.training:
            self._steps = None  # the parameters may change before the next eval call
            return self.seq(x)
        if self._steps is None:
            with torch.no_grad():
                self._steps = self._plan() or []
        if not self._steps or x.dim() != 2:
            with torch.no_grad():
                return self.seq(x)
        if torch.is_grad_enabled():
            with torch.no_grad():
                return self._run(x)
        return self._run(x)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, in] -> [R, out]."""
        cudnn = torch.backends.cudnn.enabled
        addmm, addcmul, relu_ = torch.addmm, torch.addcmul, torch.relu_
        for step in self._steps:
            kind = step[0]
            if kind == "addmm":
                x = addmm(step[1], x, step[2])
            elif kind == "affine":
                x = addcmul(step[2], x, step[1])  # beta + x * alpha
            elif kind == "relu_":
                x = relu_(x)
            elif kind == "bn":
                _, w, b, mean, var, eps = step
                x = torch.batch_norm(x, w, b, mean, var, False, 0.0, eps, cudnn)
            elif kind == "linear":
                x = torch._C._nn.linear(x, step[1], step[2])
            else:
                x = torch.relu(x)
        return x


def cpu_batch_norm_affine(bn: nn.BatchNorm1d, probe_rows: int = 64) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(alpha [C], beta [C]) with ``addcmul(beta, x, alpha)`` bitwise the eval-mode CPU kernel on x [R, C], or None.

    The CPU kernel computes, per channel, alpha = rsqrt(var + eps) * weight and beta = bias - mean * alpha, then
    x * alpha + beta (whether each multiply-add is fused is the build's choice). The same formulas in torch ops
    are checked here against the kernel on a probe of random rows spanning eight decades (and on one row), bit
    for bit, with beta also against the kernel's own output for x = 0: any difference (another build, another
    vector unit) gives None and the caller keeps the kernel. Call under ``no_grad``.
    """
    C, eps = bn.num_features, bn.eps
    w = bn.weight if bn.weight is not None else torch.ones(C)
    b = bn.bias if bn.bias is not None else torch.zeros(C)
    mean, var = bn.running_mean, bn.running_var
    if mean.dtype != torch.float32 or w.dtype != torch.float32:
        return None
    alpha = torch.rsqrt(var + eps) * w
    beta = torch.addcmul(b, mean, alpha, value=-1)

    def kernel(x: torch.Tensor) -> torch.Tensor:
        return torch.native_batch_norm(x, bn.weight, bn.bias, mean, var, False, 0.0, eps)[0]

    g = torch.Generator().manual_seed(C)
    probe = torch.randn(probe_rows, C, generator=g) * torch.logspace(-4, 4, probe_rows)[:, None]
    probe[0] = 0.0
    for x, ref in ((probe, kernel(probe)), (probe[1:2], kernel(probe[1:2]))):
        if not torch.equal(torch.addcmul(beta, x, alpha).view(torch.int32), ref.view(torch.int32)):
            return None
    if not torch.equal(beta.view(torch.int32), kernel(probe[:1])[0].view(torch.int32)):
        return None
    return alpha, beta


class EvalEncoder:
    """ExpertFlow's ``PathEncoder`` (token + position embeddings, an ``nn.TransformerEncoder`` of norm-first
    layers, a final LayerNorm, one Linear head per MoE layer) in eval mode as direct calls: per layer the one
    fused ``torch._transformer_encoder_layer_fwd`` the layer's own inference fast path calls, with the same
    float key-padding mask. Bitwise ``net(ids, pad)``.

    Used only where the modules would take that fast path themselves: eval mode, grad off, no autocast, the MHA
    fast path enabled, no hooks (checked when planned; :meth:`reset` after changing the modules), the layer
    options the fast path needs (batch-first, even heads, ReLU/GELU, ...). Anything else runs ``net`` itself.
    """

    def __init__(self, net: nn.Module) -> None:
        self.net = net
        self._plan: list[tuple] | None | bool = None  # None: not planned yet; False: the modules' own path
        self._no_padding: dict[tuple, torch.Tensor] = {}  # (shape, device): the all-zero float mask (read only)

    def reset(self) -> None:
        self._plan = None

    def _make_plan(self) -> list[tuple] | bool:
        net = self.net
        enc = net.encoder
        if getattr(enc, "use_nested_tensor", True) or enc.norm is not None or type(net.norm) is not nn.LayerNorm \
                or net.tok.max_norm is not None or net.pos.max_norm is not None \
                or any(type(head) is not nn.Linear for head in net.heads) \
                or any(m._forward_hooks or m._forward_pre_hooks for m in net.modules()):
            return False
        layers = []
        for layer in enc.layers:
            attn = layer.self_attn
            if not (type(layer) is nn.TransformerEncoderLayer and attn.batch_first and attn.in_proj_bias is not None
                    and attn._qkv_same_embed_dim and layer.activation_relu_or_gelu
                    and layer.norm1.eps == layer.norm2.eps and attn.num_heads % 2 == 0):
                return False
            layers.append((attn.embed_dim, attn.num_heads, attn.in_proj_weight, attn.in_proj_bias,
                           attn.out_proj.weight, attn.out_proj.bias, layer.activation_relu_or_gelu == 2,
                           layer.norm_first, layer.norm1.eps, layer.norm1.weight, layer.norm1.bias, layer.norm2.weight,
                           layer.norm2.bias, layer.linear1.weight, layer.linear1.bias, layer.linear2.weight,
                           layer.linear2.bias))
        return layers

    def _fast(self, ids: torch.Tensor) -> bool:
        if self.net.training or torch.is_grad_enabled() or torch.is_autocast_enabled() \
                or not torch.backends.mha.get_fastpath_enabled() or ids.device.type not in ("cpu", "cuda") \
                or _module._global_forward_hooks or _module._global_forward_pre_hooks:
            return False
        if self._plan is None:
            self._plan = self._make_plan()
        return self._plan is not False

    def __call__(self, ids: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
        """ids int64 [B, W], pad bool [B, W] (True = padding; None: no padding) -> logits [B, W, L, E]."""
        if not self._fast(ids):
            return self.net(ids, torch.zeros(ids.shape, dtype=torch.bool, device=ids.device) if pad is None else pad)
        net = self.net
        # nn.Embedding: padding_idx None -> -1; the positions 0..W-1 are the first W rows of the table
        h = torch.embedding(net.tok.weight, ids, -1, False, False) + net.pos.weight[: ids.shape[1]][None]
        if pad is None:  # F._canonical_mask of an all-False mask: zeros, made once per shape
            key = (tuple(ids.shape), ids.device, h.dtype)
            mask = self._no_padding.get(key)
            if mask is None:
                mask = self._no_padding[key] = torch.zeros(ids.shape, dtype=h.dtype, device=ids.device)
        else:
            mask = torch.zeros_like(pad, dtype=h.dtype).masked_fill_(pad, float("-inf"))  # F._canonical_mask
        for args in self._plan:
            h = torch._transformer_encoder_layer_fwd(h, *args, mask, 1)  # mask type 1: key padding
        norm = net.norm
        h = torch.layer_norm(h, norm.normalized_shape, norm.weight, norm.bias, norm.eps, torch.backends.cudnn.enabled)
        return torch.stack([torch._C._nn.linear(h, head.weight, head.bias) for head in net.heads], dim=2)
