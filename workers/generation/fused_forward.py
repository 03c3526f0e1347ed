"""FusedForward: the engine's inference forward of a ``CausalLM``, with fewer, larger ops.

``model.py``'s forward (training, reference, HF equivalence) runs ~60 small ops per layer
through nn.Module calls; at decode batch sizes on a CPU that dispatch costs as much as the
matmuls. This forward computes the same function over the same weights with ~15 ops a layer:

* one GEMM for q/k/v and one for gate/up, over fused copies of the HF-named weights
  (``[Nq + 2 Nkv, D]`` and ``[2 I, D]``); the HF parameters stay what they are;
* RoPE from a cos/sin table (built by the model's own ``rotary_emb``, so the values are
  the model's), looked up once per step and applied to q and k in one go;
* RMSNorm as ``F.rms_norm`` for fp32 (the model's formula otherwise), residual adds folded
  into the output GEMMs (``addmm``), SwiGLU as silu + in-place mul;
* with ``cpu_ops`` (the "cpu" attention backend) RMSNorm, SwiGLU and RoPE are single-pass C++
  loops (``cpu_ops.py``), RoPE in place on the qkv output, q passed on as a strided view;
* on an AVX-512 CPU, every GEMM (the fused ones, o, down, lm_head) multiplies against a
  copy of its weight laid out once for the CPU, re-made when the weights change
  (``prepack``; it replaces the fused q/k/v and gate/up copies, and adds one of o, down and
  lm_head): fp32 through this project's panel GEMM (``panel_gemm.py``), other dtypes through
  oneDNN's prepacked GEMM where torch runs it for them (``prepacked.py``).

The fused copies follow the model: before each forward ``sync()`` compares the version
counters (bumped by every in-place write: ``load_weights``' ``copy_``, an optimizer step of
a colocated trainer) and data pointers of the source parameters and rebuilds what changed.
tests/test_fused_forward.py pins this forward to ``model.py``'s.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.generation import panel_gemm, prepacked
from workers.model import AttentionBackend, CausalLM

SPLIT_GEMM_MAX_ROWS = 512  # larger (prefill) GEMMs keep MKL's own threading
# rows the prepacked weights are laid out for (a hint: 1-256 measured within 5% at 1-640 rows)
PACK_BATCH_HINT = 16


_FUSED = (1, 2, 6, 7)  # positions of the fused (engine-owned) tensors in a layer tuple


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device


def _fuse(parts: tuple[torch.Tensor | None, ...], out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Concatenate ``parts`` along dim 0, into ``out`` when given (no second copy); None for
    absent parts (no bias)."""
    if parts[0] is None:
        return None
    parts = [p.detach() for p in parts]
    if out is None:
        return torch.cat(parts).contiguous()
    return torch.cat(parts, out=out)


def _fits(old: torch.Tensor | None, parts: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether ``parts`` concatenated have ``old``'s shape, dtype and device."""
    if old is None or parts[0] is None:
        return old is None and parts[0] is None
    p0 = parts[0]
    return (old.is_contiguous() and old.shape[1:] == p0.shape[1:]
            and old.shape[0] == sum(p.shape[0] for p in parts)
            and all(p.dtype == old.dtype and p.device == old.device for p in parts))


class FusedForward:
    """``fwd(ids [T], positions [T], attn) -> hidden [T, D]``; ``fwd.logits(hidden) -> [T, V]``.
    Positions must be below ``max_len`` (the RoPE table's length)."""

    def __init__(self, model: CausalLM, max_len: int, cpu_ops: bool = False, prepack: bool | None = None):
        """``prepack``: GEMMs against prepacked weights (None: on a CPU where the packer for
        the model's dtype, ``panel_gemm`` for fp32 else ``prepacked``, says it is preferred)."""
        cfg = model.config
        self.ops = None
        if cpu_ops:
            from workers.generation import cpu_ops as ops

            self.ops = ops.load()
        p = model.model.embed_tokens.weight
        on_cpu = p.device.type == "cpu"
        # (prepack=False: not even probed, which would build the panel extension)
        self.gemm = panel_gemm if on_cpu and prepack is not False and panel_gemm.available(p.dtype) else prepacked
        runs = on_cpu and self.gemm.available(p.dtype)
        if prepack and not runs:
            raise ValueError(f"engine.cpu_prepack: prepacked GEMMs do not run here for {p.dtype} on {p.device} "
                             "(fp32 needs AVX-512; other dtypes oneDNN's, bf16 with AVX512-BF16 or AMX); "
                             "set it to 'auto' or false")
        self.prepack = runs and (self.gemm.preferred(p.dtype) if prepack is None else prepack)
        self.packed: list[tuple] = []  # per layer: qkv, o, gate/up, down (self.gemm.pack's)
        self.lm_packed = None
        self.model, self.cfg = model, cfg
        self.h, self.hkv, self.dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.dim_head
        self.nq, self.nkv, self.inter = self.h * self.dh, self.hkv * self.dh, cfg.intermediate_size
        self.eps = cfg.rms_norm_eps
        self.max_len = max_len
        self._stamp: tuple = ()
        self._src: list[torch.Tensor] = []
        self.layers: list[tuple] = []
        self.rope: torch.Tensor | None = None
        self.epoch = -1  # bumped whenever refresh() replaces tensors (0 after the first build)
        self.refreshes = -1  # bumped by every refresh(): the weights' values may have changed
        self.sync()

    @property
    def panels(self) -> bool:
        """GEMMs on panel-packed weights (``panel_gemm``): they normalise their input rows
        themselves (the input RMSNorms' weights folded into q/k/v and gate/up) and do the
        SwiGLU in the gate/up GEMM."""
        return self.prepack and self.gemm is panel_gemm

    # ---- weights -------------------------------------------------------------------------
    def _sources(self) -> list[torch.Tensor]:
        out = []
        for layer in self.model.model.layers:
            a, m = layer.self_attn, layer.mlp
            out += [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, m.gate_proj.weight, m.up_proj.weight]
            out += [b for b in (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias, m.gate_proj.bias,
                                m.up_proj.bias) if b is not None]
            if self.prepack:  # their packed copies follow them too
                out += [a.o_proj.weight, m.down_proj.weight]
            if self.panels:  # and the norm weights folded into the panels
                out += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        if self.prepack:
            out.append(self.model.lm_head.weight)
        return out

    def sync(self) -> None:
        """Rebuild the fused weights (and RoPE table) when a source parameter changed (an
        in-place write, new storage or dtype); a module given a new Parameter object, or a write
        through ``.data`` (which bumps no version counter), is not seen until ``refresh()``
        (``load_weights`` calls it)."""
        stamp = tuple((p._version, p.data_ptr(), p.dtype) for p in self._src)
        if stamp != self._stamp or not self._src:
            self.refresh()

    def refresh(self) -> None:
        """Rebuild the fused weights and the RoPE table from the model's parameters now.
        New values are concatenated straight into the existing fused tensors (CUDA graphs
        hold their addresses; no transient second copy of the fused weights); ``epoch``
        counts the times a tensor had to be replaced instead."""
        self._src = self._sources()
        stamp = tuple((p._version, p.data_ptr(), p.dtype) for p in self._src)
        layers = []  # as self.layers, with the fused slots still tuples of parts
        for layer in self.model.model.layers:
            a, m = layer.self_attn, layer.mlp
            layers.append((
                layer.input_layernorm.weight,
                (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight),
                (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias),
                a.o_proj.weight, a.o_proj.bias,
                layer.post_attention_layernorm.weight,
                (m.gate_proj.weight, m.up_proj.weight),
                (m.gate_proj.bias, m.up_proj.bias),
                m.down_proj.weight, m.down_proj.bias))
        rope = self._rope_table()
        with torch.no_grad():
            if self.prepack:
                self._pack(layers, rope)
            elif self._same_layout(layers, rope):
                for old, new in zip(self.layers, layers):
                    for i in _FUSED:
                        _fuse(new[i], out=old[i])
                self.rope.copy_(rope)
            else:
                self.layers = [tuple(_fuse(x) if i in _FUSED else x for i, x in enumerate(new))
                               for new in layers]
                self.rope = rope
                self.epoch += 1
        self._stamp = stamp
        self.refreshes += 1

    def _pack(self, layers: list[tuple], rope: torch.Tensor) -> None:
        """Prepacked weights only: each fused q/k/v and gate/up weight is packed straight from
        a transient concatenation (one layer's at a time), and the plain fused copies are not
        kept (``layers[i][1]``, ``[6]`` are None): the packed copy is the only one the forward
        reads. For Qwen2.5-7B in bf16 that is 8.5 GB not held. Every tensor is new: ``epoch``
        is bumped (the packed layout has no CUDA graphs to keep)."""
        pk = lambda w: self.gemm.pack(w, PACK_BATCH_HINT)  # noqa: E731
        self.packed, self.lm_packed = [], None  # the old copies go first: no second set at the peak
        if self.panels:  # the RMSNorms fold into q/k/v and gate/up; SwiGLU as an epilogue
            pk_qkv = lambda new: panel_gemm.pack(_fuse(new[1]), norm=(new[0], self.eps))  # noqa: E731
            pk_gu = lambda new: panel_gemm.pack_swiglu(*new[6], norm=(new[5], self.eps))  # noqa: E731
        else:
            pk_qkv, pk_gu = (lambda new: pk(_fuse(new[1]))), (lambda new: pk(_fuse(new[6])))
        self.packed = [(pk_qkv(new), pk(new[3]), pk_gu(new), pk(new[8])) for new in layers]
        self.lm_packed = pk(self.model.lm_head.weight)
        self.layers = [tuple(None if i in (1, 6) else _fuse(x) if i in _FUSED else x for i, x in enumerate(new))
                       for new in layers]
        self.rope = rope
        self.epoch += 1

    def _same_layout(self, layers: list[tuple], rope: torch.Tensor) -> bool:
        """Whether ``layers`` can be written into the current tensors: same parameter objects,
        fused parts that fill the current fused tensors' shapes, dtypes and devices."""
        if self.rope is None or len(layers) != len(self.layers) or not _alike(self.rope, rope):
            return False
        for old, new in zip(self.layers, layers):
            for i, (a, b) in enumerate(zip(old, new)):
                if i in _FUSED:
                    if not _fits(a, b):
                        return False
                elif a is not b:
                    return False
        return True

    def _rope_table(self) -> torch.Tensor:
        """cos, sign-folded sin: [max_len, 2, Dh]; rotate_half(x) * sin == swap_halves(x) * sin_s."""
        p = self.model.model.embed_tokens.weight
        pos = torch.arange(self.max_len, device=p.device)
        cos, sin = self.model.model.rotary_emb(pos, p.dtype)  # [L, 1, Dh]: the model's own values
        half = self.dh // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return torch.stack((cos[:, 0], sin[:, 0]), dim=1).contiguous()  # [L, 2, Dh]

    # ---- forward -------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, w, self.eps)
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        xf = x.float()  # the model's formula (upcast, normalise, round, scale)
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def _qkv(self, qkv: torch.Tensor, cs: torch.Tensor):
        """qkv: [T, Nq + 2 Nkv], cs: [T, 2, Dh] -> q [T, H, Dh], k, v [T, Hkv, Dh], q/k rotated."""
        t, h, hkv, dh, nq, nkv = qkv.shape[0], self.h, self.hkv, self.dh, self.nq, self.nkv
        v = qkv[:, nq + nkv:].view(t, hkv, dh)
        if self.ops is not None:
            self.ops.rope_(qkv, cs, h + hkv)  # in place: q and k stay views of qkv
            return qkv[:, :nq].view(t, h, dh), qkv[:, nq:nq + nkv].view(t, hkv, dh), v
        qk = qkv[:, :nq + nkv].view(t, h + hkv, dh)
        swapped = qk.reshape(t, h + hkv, 2, dh // 2).flip(2).view(t, h + hkv, dh)
        qk = (qk * cs[:, None, 0]).addcmul_(swapped, cs[:, None, 1])
        return qk[:, :h], qk[:, h:], v

    def _swiglu(self, gu: torch.Tensor) -> torch.Tensor:
        # gu: [T, 2 I] -> silu(gate) * up: [T, I]
        if self.ops is not None:
            return self.ops.silu_mul(gu)
        return F.silu(gu[:, :self.inter]).mul_(gu[:, self.inter:])

    def _mlp_act(self, h: torch.Tensor, wgu: torch.Tensor, bgu, packed=None) -> torch.Tensor:
        """silu(h @ Wg.T + bg) * (h @ Wu.T + bu): [T, I]; one GEMM with the SwiGLU in its
        epilogue on panel-packed weights, else the gate/up GEMM, then the SwiGLU."""
        if self.panels:
            return panel_gemm.swiglu(h, packed, bgu)
        return self._swiglu(self._linear(h, wgu, bgu, packed))

    def _split(self, a: torch.Tensor) -> bool:
        """With cpu_ops, decode-sized GEMMs are split by output columns over the threads."""
        return self.ops is not None and a.shape[0] <= SPLIT_GEMM_MAX_ROWS

    def _linear(self, a: torch.Tensor, w: torch.Tensor, b, packed=None) -> torch.Tensor:
        if packed is not None:
            return self.gemm.linear(a, packed, b)
        return self.ops.linear(a, w, b) if self._split(a) else F.linear(a, w, b)

    def _residual_linear(self, x: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b, packed=None) -> torch.Tensor:
        if packed is not None:
            return self.gemm.linear(a, packed, b, add=x)  # x + a @ w.T + b in one GEMM
        if b is None and self._split(a):
            return self.ops.linear(a, w, x)  # x + a @ w.T, columns split over the threads
        out = torch.addmm(x, a, w.t())  # x + a @ w.T in one GEMM
        return out if b is None else out.add_(b)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        self.sync()
        t = input_ids.shape[0]
        x = F.embedding(input_ids, self.model.model.embed_tokens.weight)  # [T, D]
        cs = self.rope.index_select(0, positions)  # [T, 2, Dh]
        for i, (ln1, wqkv, bqkv, wo, bo, ln2, wgu, bgu, wd, bd) in enumerate(self.layers):
            pqkv, po, pgu, pd = self.packed[i] if self.prepack else (None,) * 4
            h = x if self.panels else self._norm(x, ln1)  # else the GEMM normalises
            q, k, v = self._qkv(self._linear(h, wqkv, bqkv, pqkv), cs)
            o = attn(i, q, k, v)  # [T, H, Dh]
            x = self._residual_linear(x, o.reshape(t, self.nq), wo, bo, po)
            act = self._mlp_act(x if self.panels else self._norm(x, ln2), wgu, bgu, pgu)  # [T, I]
            x = self._residual_linear(x, act, wd, bd, pd)
        return self._norm(x, self.model.model.norm.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [B, D] -> [B, V] (the model's lm_head; column-split over the threads like
        the layers' GEMMs)."""
        if self.prepack:
            return self.gemm.linear(hidden, self.lm_packed, self.model.lm_head.bias)
        if self._split(hidden):
            return self.ops.linear(hidden, self.model.lm_head.weight, self.model.lm_head.bias)
        return self.model.logits(hidden)
