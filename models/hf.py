"""Hugging Face checkpoints in and out: Llama, Qwen2, Qwen3, Mixtral, Qwen2-MoE and Qwen3-MoE causal LMs.

  model, config = models.from_hf("path/to/hf_dir", mesh=mesh)   # config.json + *.safetensors, straight to shards
  models.to_hf(model, "out_dir")                                 # loads with transformers.AutoModelForCausalLM

HF `nn.Linear` weights are (out, in); ours are (fan_in, fan_out), so every matrix is transposed. Per-layer tensors
stack on our leading `layers` axis, per-expert ones on the `expert` axis. Each array is built shard by shard from
`safetensors` slices (`jax.make_array_from_callback`): no torch, and no host copy of a whole stacked leaf when a mesh
splits it. A config field or tensor the model cannot represent exactly is refused with one `HFError` line naming it,
never a silently different model.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from typing import Any

import jax
import numpy as np
from flax import nnx

from models.config import MoEConfig, TransformerConfig
from models.transformer import Transformer
from sharding.state import logical_names, param_shardings

ARCHITECTURES = {  # architecture -> (model_type, MoE family or None)
    "LlamaForCausalLM": ("llama", None),
    "Qwen2ForCausalLM": ("qwen2", None),
    "Qwen3ForCausalLM": ("qwen3", None),
    "MixtralForCausalLM": ("mixtral", "mixtral"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "qwen"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "qwen"),
}


class HFError(ValueError):
  """A Hugging Face checkpoint (or an export) that the model cannot represent exactly."""


# ---- config -----------------------------------------------------------------------------------------------------


def _rope_theta(hf: dict) -> float:
  """rope_theta from a v4 config (`rope_theta`, `rope_scaling`) or a v5 one (`rope_parameters`).

  Only the plain rotary embedding is implemented.
  """
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  for field, d in (("rope_scaling", scaling), ("rope_parameters", params)):
    kind = d.get("rope_type", d.get("type", "default"))
    if kind != "default":
      raise HFError(f"{field}: rope type {kind!r} is not implemented (only the default rotary embedding)")
    if d.get("partial_rotary_factor", 1.0) != 1.0:
      raise HFError(f"{field}.partial_rotary_factor={d['partial_rotary_factor']} is not implemented")
  if hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise HFError(f"partial_rotary_factor={hf['partial_rotary_factor']} is not implemented")
  return float(hf.get("rope_theta") or params.get("rope_theta") or 10_000.0)


def _refuse(hf: dict, field: str, ok, why: str):
  if field in hf and hf[field] is not None and not ok(hf[field]):
    raise HFError(f"{field}={hf[field]!r}: {why}")


def config_from_hf(hf: dict, dtype: str | None = None) -> tuple[str, TransformerConfig]:
  """The architecture and `TransformerConfig` of an HF config.json.

  Args:
    hf: the config.json as a dict.
    dtype: the parameter dtype; None: the config's `dtype` or `torch_dtype` (float32 if neither).

  Returns:
    (architecture, TransformerConfig).

  Raises:
    HFError: naming the first field the model cannot represent (an unknown architecture, a rope scaling, sliding
      windows, biases, non-MoE layers in an MoE).
  """
  archs = hf.get("architectures") or []
  if len(archs) != 1 or archs[0] not in ARCHITECTURES:
    raise HFError(f"architectures={archs!r}: supported are {', '.join(ARCHITECTURES)}")
  arch = archs[0]
  model_type, moe_family = ARCHITECTURES[arch]
  _refuse(hf, "hidden_act", lambda v: v == "silu", "only SwiGLU with silu is implemented")
  _refuse(hf, "use_sliding_window", lambda v: not v, "sliding-window attention is not implemented")
  if moe_family == "mixtral" or model_type == "llama":
    _refuse(hf, "sliding_window", lambda v: False, "sliding-window attention is not implemented")
  _refuse(hf, "layer_types", lambda v: all(t == "full_attention" for t in v),
          "sliding-window attention is not implemented")
  _refuse(hf, "attention_bias", lambda v: not v, "biases on all four attention projections are not implemented")
  _refuse(hf, "mlp_bias", lambda v: not v, "MLP biases are not implemented")
  _refuse(hf, "decoder_sparse_step", lambda v: v == 1, "every layer must be an MoE layer")
  _refuse(hf, "mlp_only_layers", lambda v: not v, "every layer must be an MoE layer")
  moe = None
  if moe_family == "mixtral":
    moe = MoEConfig(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                    d_expert=hf["intermediate_size"], normalize_top_k=True,
                    lb_weight=hf.get("router_aux_loss_coef", 0.02), z_weight=0.0)
  elif moe_family == "qwen":
    shared = (hf.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
    experts: Any = hf.get("num_experts") or hf.get("num_local_experts")  # v4 name, v5 name
    moe = MoEConfig(num_experts=experts, top_k=hf["num_experts_per_tok"],
                    d_expert=hf["moe_intermediate_size"], normalize_top_k=bool(hf.get("norm_topk_prob", False)),
                    num_shared=1 if shared else 0, d_shared=shared or None, shared_gate=bool(shared),
                    lb_weight=hf.get("router_aux_loss_coef", 0.001), z_weight=0.0)
  if dtype is None:
    dtype = hf.get("dtype") or hf.get("torch_dtype") or "float32"
  d_ff: Any = hf.get("intermediate_size") or (moe.d_expert if moe else 0)  # a JSON value; TransformerConfig checks it
  config = TransformerConfig(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
      n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
      head_dim=None if hf.get("head_dim") in (None, hf["hidden_size"] // hf["num_attention_heads"]) else hf["head_dim"],
      d_ff=d_ff,
      qk_norm=model_type in ("qwen3", "qwen3_moe"),
      qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and hf.get("qkv_bias", True)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)), rope_theta=_rope_theta(hf),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)), param_dtype=str(dtype), moe=moe)
  return arch, config


def architecture_of(c: TransformerConfig) -> str:
  """The HF architecture that represents `c` exactly.

  Args:
    c: the model configuration.

  Returns:
    A key of `ARCHITECTURES`.

  Raises:
    HFError: naming what no supported architecture can represent (a sigmoid router, a shared expert other than
      Qwen2-MoE's, q/k/v biases with QK-norm or in an MoE without a shared expert).
  """
  m = c.moe
  if m is not None:
    if m.router != "softmax":
      raise HFError(f"moe.router={m.router!r}: the supported HF MoE architectures route with a softmax")
    if m.shared_gate or m.num_shared:
      if not (m.shared_gate and m.num_shared == 1 and not c.qk_norm):
        raise HFError("a shared expert is exported as Qwen2-MoE: it needs moe.num_shared=1, moe.shared_gate=True "
                      "and qk_norm=False")
      return "Qwen2MoeForCausalLM"
    if c.qkv_bias:
      raise HFError("qkv_bias: an MoE without a shared expert (Mixtral, Qwen3-MoE) has no q/k/v biases")
    return "Qwen3MoeForCausalLM" if c.qk_norm or not m.normalize_top_k else "MixtralForCausalLM"
  if c.qkv_bias and c.qk_norm:
    raise HFError("qkv_bias with qk_norm: no supported architecture has both")
  return "Qwen2ForCausalLM" if c.qkv_bias else "Qwen3ForCausalLM" if c.qk_norm else "LlamaForCausalLM"


def config_to_hf(c: TransformerConfig, arch: str) -> dict:
  """The HF config.json of `c` as architecture `arch`.

  Args:
    c: the model configuration.
    arch: a key of `ARCHITECTURES` that represents `c` (`architecture_of`).

  Returns:
    The config.json dict.
  """
  model_type, family = ARCHITECTURES[arch]
  hf: dict[str, Any] = dict(
      architectures=[arch], model_type=model_type, vocab_size=c.vocab_size, hidden_size=c.d_model,
      intermediate_size=c.d_ff, num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
      num_key_value_heads=c.kv_heads, head_dim=c.hd, hidden_act="silu", rms_norm_eps=c.norm_eps,
      rope_theta=c.rope_theta, rope_scaling=None, tie_word_embeddings=c.tie_embeddings, torch_dtype=c.param_dtype,
      attention_bias=False, use_sliding_window=False, sliding_window=None)
  m = c.moe
  if family == "mixtral":
    assert m is not None  # an MoE architecture: `arch` represents c, so c has an MoE
    hf.update(num_local_experts=m.num_experts, num_experts_per_tok=m.top_k, intermediate_size=m.d_expert or c.d_ff,
              router_aux_loss_coef=m.lb_weight)
  elif family == "qwen":
    assert m is not None
    hf.update(num_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.d_expert or c.d_ff,
              norm_topk_prob=m.normalize_top_k, decoder_sparse_step=1, mlp_only_layers=[],
              router_aux_loss_coef=m.lb_weight)
    if model_type == "qwen2_moe":
      hf.update(shared_expert_intermediate_size=m.d_shared or m.num_shared * (m.d_expert or c.d_ff),
                qkv_bias=c.qkv_bias)
  return hf


# ---- tensor names -----------------------------------------------------------------------------------------------


def tensor_map(c: TransformerConfig, arch: str) -> dict[tuple, tuple[str, bool]]:
  """Our parameter path -> (HF name template, transposed).

  Templates take {l} (layer) and {e} (expert); the number of placeholders is the number of leading stack axes of our
  leaf.

  Args:
    c: the model configuration.
    arch: a key of `ARCHITECTURES`.

  Returns:
    {path: (template, transposed)} for every parameter of `Transformer(c)`.
  """
  family = ARCHITECTURES[arch][1]
  L = "model.layers.{l}."
  out: dict[tuple, tuple[str, bool]] = {("embed_VD",): ("model.embed_tokens.weight", False),
                                        ("final_norm",): ("model.norm.weight", False)}
  if not c.tie_embeddings:
    out[("head_DV",)] = ("lm_head.weight", True)
  blk: dict[str | tuple[str, str], tuple[str, bool]] = {
      "attn_norm": (L + "input_layernorm.weight", False), "mlp_norm": (L + "post_attention_layernorm.weight", False),
      "wq_DQ": (L + "self_attn.q_proj.weight", True), "wk_DK": (L + "self_attn.k_proj.weight", True),
      "wv_DK": (L + "self_attn.v_proj.weight", True), "wo_QD": (L + "self_attn.o_proj.weight", True)}
  if c.qkv_bias:
    blk |= {"q_bias_Q": (L + "self_attn.q_proj.bias", False), "k_bias_K": (L + "self_attn.k_proj.bias", False),
            "v_bias_K": (L + "self_attn.v_proj.bias", False)}
  if c.qk_norm:
    blk |= {"q_norm": (L + "self_attn.q_norm.weight", False), "k_norm": (L + "self_attn.k_norm.weight", False)}
  if c.moe is None:
    blk |= {"w_gate_DF": (L + "mlp.gate_proj.weight", True), "w_up_DF": (L + "mlp.up_proj.weight", True),
            "w_down_FD": (L + "mlp.down_proj.weight", True)}
  elif family == "mixtral":
    E = L + "block_sparse_moe.experts.{e}."
    blk |= {("moe", "router_DE"): (L + "block_sparse_moe.gate.weight", True),
            ("moe", "w_gate_EDF"): (E + "w1.weight", True), ("moe", "w_up_EDF"): (E + "w3.weight", True),
            ("moe", "w_down_EFD"): (E + "w2.weight", True)}
  else:
    E = L + "mlp.experts.{e}."
    blk |= {("moe", "router_DE"): (L + "mlp.gate.weight", True),
            ("moe", "w_gate_EDF"): (E + "gate_proj.weight", True), ("moe", "w_up_EDF"): (E + "up_proj.weight", True),
            ("moe", "w_down_EFD"): (E + "down_proj.weight", True)}
    if c.moe.num_shared:
      S = L + "mlp.shared_expert."
      blk |= {("moe", "shared_gate_DS"): (S + "gate_proj.weight", True),
              ("moe", "shared_up_DS"): (S + "up_proj.weight", True),
              ("moe", "shared_down_SD"): (S + "down_proj.weight", True)}
      if c.moe.shared_gate:
        blk[("moe", "shared_router_D1")] = (L + "mlp.shared_expert_gate.weight", True)
  for k, v in blk.items():
    out[("blocks",) + (k if isinstance(k, tuple) else (k,))] = v
  return out


def _stack_axes(template: str) -> int:
  return template.count("{l}") + template.count("{e}")


def _names(template: str, lead: tuple[int, ...]) -> str:
  return template.format(**dict(zip(("l", "e"), lead)))


def _flat(tree: dict, prefix=()) -> dict[tuple, Any]:
  out: dict[tuple, Any] = {}
  for k, v in tree.items():
    out.update(_flat(v, prefix + (k,)) if isinstance(v, dict) else {prefix + (k,): v})
  return out


# ---- files --------------------------------------------------------------------------------------------------------


class _Checkpoint:
  """The tensors of an HF directory: model.safetensors or model.safetensors.index.json + shards.

  Files are opened for each read and closed after it: safetensors memory-maps them, and the mapped pages a read
  touches count as this process's resident memory until the file is closed, so keeping every file open would hold
  the whole checkpoint's pages resident beside the arrays built from them.

  Args:
    path: the HF model directory.

  Raises:
    HFError: when the directory has no safetensors, a file cannot be read, or the index lists a tensor no file holds.
  """

  def __init__(self, path: str):
    from safetensors import safe_open
    self._open = safe_open
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
      try:
        weight_map = json.load(open(index))["weight_map"]
      except (ValueError, KeyError) as e:
        raise HFError(f"{index}: not a safetensors index ({e})") from None
      files = sorted(set(weight_map.values()))
    elif os.path.exists(single):
      files, weight_map = ["model.safetensors"], None
    else:
      raise HFError(f"{path}: no model.safetensors or model.safetensors.index.json")
    self.where = {}
    for f in files:
      full = os.path.join(path, f)
      try:
        with safe_open(full, framework="np") as h:
          self.where.update(dict.fromkeys(h.keys(), full))
      except Exception as e:  # a missing, truncated or garbled file: one line
        raise HFError(f"{full}: cannot be read as safetensors ({str(e).splitlines()[0]})") from None
    if weight_map is not None:
      missing = sorted(set(weight_map) - set(self.where))
      if missing:
        raise HFError(f"{missing[0]}: listed in the index but not in {weight_map[missing[0]]}")

  def read(self, name: str, index: tuple | None = None, shape: tuple | None = None) -> np.ndarray:
    """Tensor `name`, or its region `index`, as a numpy array.

    Args:
      name: the HF tensor name.
      index: a tuple of slices, the region to read; None: the whole tensor.
      shape: the shape the stored tensor must have; None: any.

    Returns:
      The tensor (region).

    Raises:
      HFError: when the tensor is missing, or its shape is not `shape`.
    """
    if name not in self.where:
      raise HFError(f"{name}: missing from the checkpoint")
    with self._open(self.where[name], framework="np") as h:
      sl = h.get_slice(name)
      if shape is not None and tuple(sl.get_shape()) != tuple(shape):
        raise HFError(f"{name}: shape {tuple(sl.get_shape())}, the config implies {tuple(shape)}")
      return np.array(sl[index] if index is not None else sl[:])


def _read_region(ckpt: _Checkpoint, template: str, transposed: bool, index: tuple, shape: tuple, dtype):
  """Our array's region `index` (a tuple of slices over `shape`) read from the HF tensors it comes from."""
  lead = _stack_axes(template)
  ranges = [range(*s.indices(n)) for s, n in zip(index, shape)]
  tail = tuple(slice(r.start, r.stop) for r in ranges[lead:])
  out = np.empty(tuple(len(r) for r in ranges), dtype)
  want = shape[lead:][::-1] if transposed else shape[lead:]
  for pos in np.ndindex(*(len(r) for r in ranges[:lead])):
    name = _names(template, tuple(r[i] for r, i in zip(ranges[:lead], pos)))
    block = ckpt.read(name, tail[::-1] if transposed else tail, want)
    out[pos] = block.T if transposed else block
  return out


def from_hf(path: str, mesh: jax.sharding.Mesh | None = None,
            dtype: str | None = None) -> tuple[Transformer, TransformerConfig]:
  """The Hugging Face model in directory `path` as (Transformer, TransformerConfig).

  Args:
    path: a local directory with config.json and model.safetensors (or a sharded model.safetensors.index.json).
    mesh: place each parameter on its shards of this mesh (the logical rules in sharding/rules.py); None: one
      device. Each shard is read from the files on its own.
    dtype: parameter dtype ("float32", "bfloat16"); None keeps the checkpoint's `torch_dtype`.

  Returns:
    (model, config): the `Transformer`, its parameters placed by `mesh`, and its `TransformerConfig`.

  Raises:
    HFError: naming the config field or tensor that the model cannot represent (a rope scaling or sliding window, an
      unknown architecture, a missing, extra or misshapen tensor), or a missing or invalid config.json.
  """
  cfg_path = os.path.join(path, "config.json")
  try:
    hf = json.load(open(cfg_path))
  except FileNotFoundError:
    raise HFError(f"{cfg_path}: not found (a Hugging Face model directory has config.json)") from None
  except ValueError as e:
    raise HFError(f"{cfg_path}: not valid JSON ({e})") from None
  arch, config = config_from_hf(hf, dtype)
  ckpt = _Checkpoint(path)
  names = tensor_map(config, arch)
  graphdef, abstract, logical = logical_names(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  shardings = param_shardings(abstract, logical, mesh)
  flat_abs, flat_sh = _flat(abstract), _flat(shardings)
  if set(flat_abs) != set(names):
    raise HFError(f"internal: no HF name for {sorted(set(flat_abs) - set(names))}")
  used: set[str] = set()
  for p, (template, _) in names.items():
    lead = flat_abs[p].shape[:_stack_axes(template)]
    used.update(_names(template, i) for i in np.ndindex(*lead))
  extra = sorted(set(ckpt.where) - used - {"lm_head.weight"})
  extra = [n for n in extra if not n.endswith("rotary_emb.inv_freq")]  # a buffer some old checkpoints saved
  if extra:
    raise HFError(f"{extra[0]}: a tensor this {arch} config does not use ({len(extra)} unexpected)")
  if config.tie_embeddings and "lm_head.weight" in ckpt.where:
    if not np.array_equal(ckpt.read("lm_head.weight"), ckpt.read("model.embed_tokens.weight")):
      raise HFError("lm_head.weight differs from model.embed_tokens.weight but tie_word_embeddings=true")
  flat = {}
  for p, (template, transposed) in names.items():
    a = flat_abs[p]
    flat[p] = jax.make_array_from_callback(
        a.shape, flat_sh[p], functools.partial(_read_region, ckpt, template, transposed, shape=a.shape, dtype=a.dtype))
  params: dict[str, Any] = {}
  for p, v in flat.items():
    node = params
    for k in p[:-1]:
      node = node.setdefault(k, {})
    node[p[-1]] = v
  model = nnx.merge(graphdef, params)
  return model, config


def to_hf(model: Transformer, path: str, architecture: str | None = None) -> str:
  """Write `model` as a Hugging Face directory (config.json + model.safetensors).

  `transformers.AutoModelForCausalLM.from_pretrained(path)` loads it. Refuses to write into a non-empty directory; the
  files appear together (written to a temporary directory, then renamed).

  Args:
    model: the transformer.
    path: the directory to create.
    architecture: the HF architecture (checked); None: the one that represents the config exactly
      (`architecture_of`).

  Returns:
    `path`.

  Raises:
    HFError: when no supported architecture (or not `architecture`) represents the config, the router's selection
      bias is nonzero, or `path` is not empty.
  """
  c = model.c
  arch = architecture or architecture_of(c)
  if arch not in ARCHITECTURES:
    raise HFError(f"architecture={arch!r}: supported are {', '.join(ARCHITECTURES)}")
  if architecture and architecture != architecture_of(c):
    raise HFError(f"architecture={architecture!r} cannot represent this config (it is {architecture_of(c)})")
  rest = nnx.state(model, nnx.Not(nnx.Param))
  bias = [np.asarray(v) for v in jax.tree.leaves(rest)]
  if any(np.any(b != 0) for b in bias):
    raise HFError("moe.bias_rate: the router's selection bias is nonzero and HF routers have none")
  if os.path.exists(path) and os.listdir(path):  # before the tensors are gathered
    raise HFError(f"{path}: exists and is not empty; nothing was written")
  flat = _flat(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  tensors = {}
  for p, (template, transposed) in tensor_map(c, arch).items():
    x = np.asarray(jax.device_get(flat[p]))
    lead = _stack_axes(template)
    for pos in np.ndindex(*x.shape[:lead]):
      block = x[pos]
      tensors[_names(template, pos)] = np.ascontiguousarray(block.T if transposed else block)
  return write_dir(path, {"model.safetensors": tensors, "config.json": config_to_hf(c, arch)})


def write_dir(path: str, files: dict[str, Any]) -> str:
  """Creates directory `path` holding `files`, all at once: written to a temporary directory beside it, then renamed.

  Args:
    path: the directory to create (it may exist empty).
    files: name -> content: a dict of arrays for a name ending in .safetensors, else a JSON-able object.

  Returns:
    `path`.

  Raises:
    HFError: when `path` exists and is not empty.
    BaseException: any error of the writing, re-raised once the temporary directory is removed.
  """
  from safetensors.numpy import save_file
  if os.path.exists(path) and os.listdir(path):
    raise HFError(f"{path}: exists and is not empty; nothing was written")
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)
  tmp = tempfile.mkdtemp(prefix=".hf-export-", dir=parent)
  try:
    for name, content in files.items():
      if name.endswith(".safetensors"):
        save_file(content, os.path.join(tmp, name), metadata={"format": "pt"})
      else:
        with open(os.path.join(tmp, name), "w") as f:
          json.dump(content, f, indent=2)
    if os.path.exists(path):
      os.rmdir(path)
    os.rename(tmp, path)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return path
