"""A quantized model on disk: its codes bit-packed at their real widths, so the directory's size is the model's.

  save(model, "runs/q4")          # config.json (model config, plan) + quantized.safetensors
  model, config, plan = load("runs/q4", mesh=mesh)

Each layer's codes are packed at that layer's width (b bits per code, two's complement; a 16-bit layer's bfloat16
bit patterns), into uint8; scales, zero points and smoothing vectors are float32, and every parameter left in full
precision keeps the model's parameter dtype. `stored_bytes` is the size the files take; `full_bytes` the same
model's parameters unquantized (float32 and bfloat16).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import TransformerConfig
from models.hf import write_dir
from models.quant import (
  PLAN_FORMAT,
  Piece,
  QuantError,
  Quantized,
  by_path,
  check_plan,
  owner,
  plan_from_json,
  plan_to_json,
  quantized,
)
from models.transformer import Transformer
from sharding.state import place_variables, variable_names

FORMAT = "optlab.quantized.v1"
WEIGHTS = "quantized.safetensors"


def pack(codes: jax.Array | np.ndarray, bits: int) -> np.ndarray:
  """The uint8 bytes of `codes` at `bits` per entry, little-endian bit order.

  Args:
    codes: integer codes (any shape), or the weights themselves at 16 or 32 bits.
    bits: 2, 3, 4 or 8: the low `bits` of each integer (two's complement); 16 (32): the bfloat16 (float32) bit
      pattern of each weight.

  Returns:
    A flat uint8 array of ⌈n·bits/8⌉ bytes.
  """
  if bits == 16:
    return np.asarray(jnp.asarray(codes, jnp.bfloat16)).view(np.uint16).astype("<u2").view(np.uint8).ravel()
  if bits == 32:
    return np.asarray(codes, np.float32).astype("<f4").view(np.uint8).ravel()
  u = (np.asarray(codes).astype(np.int16).ravel() & (2 ** bits - 1)).astype(np.uint8)
  return np.packbits(np.unpackbits(u[:, None], axis=1, bitorder="little")[:, :bits].ravel(), bitorder="little")


def unpack(data: np.ndarray, bits: int, shape: tuple[int, ...]) -> np.ndarray:
  """The inverse of `pack`.

  Args:
    data: the uint8 bytes `pack` wrote.
    bits: their width per entry.
    shape: the codes' shape.

  Returns:
    int8 codes of `shape` (bfloat16 weights at 16 bits, float32 at 32).
  """
  n = int(np.prod(shape))
  if bits == 16:
    return np.frombuffer(np.ascontiguousarray(data).tobytes()[:2 * n], "<u2").view(jnp.bfloat16).reshape(shape)
  if bits == 32:
    return np.frombuffer(np.ascontiguousarray(data).tobytes()[:4 * n], "<f4").reshape(shape)
  b = np.unpackbits(data, bitorder="little")[:n * bits].reshape(n, bits).astype(np.int16)
  u = (b << np.arange(bits, dtype=np.int16)).sum(1)
  return np.where(u >= 2 ** (bits - 1), u - 2 ** bits, u).astype(np.int8).reshape(shape)


def _tensors(model: nnx.Module) -> tuple[dict, dict]:
  """(safetensors dict, {path: codes shape of one layer}) of a quantized model."""
  out, shapes = {}, {}
  for p, node in quantized(model):
    codes = np.asarray(node.codes[...].astype(jnp.float32))
    shapes[p] = list(codes.shape[1:])
    for layer, bits in enumerate(node.bits):
      out[f"{p}.codes.{layer}"] = pack(codes[layer], bits)
    out[f"{p}.scale"] = np.asarray(node.scale[...], np.float32)
    out[f"{p}.smooth"] = np.asarray(node.smooth[...], np.float32)
    if node.zero is not None:
      out[f"{p}.zero"] = np.asarray(node.zero[...], np.float32)
  for p, v in by_path(nnx.state(model, nnx.Param)).items():
    out[p] = np.asarray(v.get_value())
  return out, shapes


def save(model: Transformer, path: str, source: str | None = None, extra: dict | None = None) -> str:
  """Writes the quantized `model` to a new directory `path`, written whole or not at all.

  The directory holds config.json (the model config, the plan, the codes' shapes, `source`) and quantized.safetensors
  (the packed codes, the float32 scales, zero points and smoothing, the other parameters in their dtype).

  Args:
    model: a model `models.quant.quantize` quantized.
    path: the directory (refused if it exists and is not empty).
    source: where the model came from, recorded in config.json; default None.
    extra: {file name: JSON-able content} written beside it; default none.

  Returns:
    `path`.

  Raises:
    QuantError: when the model has no quantized weight.
  """
  plan = {p: list(q.specs) for p, q in quantized(model)}
  if not plan:
    raise QuantError("the model has no quantized weight; quantize it first (models.quant.quantize)")
  tensors, shapes = _tensors(model)
  meta = {"format": FORMAT, "model_config": dataclasses.asdict(model.c), "plan": plan_to_json(plan),
          "codes_shapes": shapes, "source": source}
  return write_dir(path, {**(extra or {}), "config.json": meta, WEIGHTS: tensors})


def stored_bytes(path: str) -> int:
  """Bytes of a saved quantized model.

  Args:
    path: the directory `save` wrote.

  Returns:
    The size of its weights file and its config.json (not the plan, tokenizer or reports written beside them).
  """
  return sum(os.path.getsize(os.path.join(path, f)) for f in (WEIGHTS, "config.json"))


def full_bytes(config: TransformerConfig, dtype: jax.typing.DTypeLike = jnp.float32) -> int:
  """Bytes of the model's parameters unquantized, at `dtype`.

  Args:
    config: the model's config (the model is built abstractly, no parameter allocated).
    dtype: the parameters' dtype (default float32).

  Returns:
    The parameter count times the dtype's item size.
  """
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param))) * jnp.dtype(dtype).itemsize


def load(path: str, mesh: jax.sharding.Mesh | None = None) -> tuple[Transformer, TransformerConfig, dict]:
  """A saved quantized model, ready to run.

  Args:
    path: the directory `save` wrote.
    mesh: where its variables are placed, by their logical names; None (default): one device.

  Returns:
    (model, config, plan).

  Raises:
    QuantError: when config.json or the weights file is missing, unreadable or of another format, or a tensor is
      missing, of the wrong shape or inconsistent (and as `models.quant.check_plan` does for the plan).
  """
  from safetensors import SafetensorError
  from safetensors.numpy import load_file
  try:
    with open(os.path.join(path, "config.json")) as f:
      meta = json.load(f)
  except FileNotFoundError:
    raise QuantError(f"{path}: no config.json (not a quantized model directory)") from None
  except ValueError as e:
    raise QuantError(f"{path}/config.json: not valid JSON ({e})") from None
  if not isinstance(meta, dict) or meta.get("format") != FORMAT:
    raise QuantError(f"{path}: not a quantized model (config.json format is not {FORMAT!r})")
  try:
    tensors = load_file(os.path.join(path, WEIGHTS))
  except FileNotFoundError:
    raise QuantError(f"{path}: no {WEIGHTS}") from None
  except (SafetensorError, OSError, ValueError) as e:
    raise QuantError(f"{path}/{WEIGHTS}: unreadable ({e})") from None
  config = TransformerConfig(**meta["model_config"])
  plan = plan_from_json(meta.get("plan", {"format": PLAN_FORMAT}))
  model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  check_plan(model, plan)
  try:
    for key, v in by_path(nnx.state(model, nnx.Param)).items():
      if key not in plan:
        v.set_value(_array(tensors, key, v.shape).astype(v.dtype))
    for p, specs in plan.items():
      module, attr = owner(model, p)
      weight = getattr(module, attr)
      shape = tuple(meta["codes_shapes"][p])
      G = tensors[f"{p}.scale"].shape[-2]
      pieces = []
      for layer, spec in enumerate(specs):
        codes = unpack(_array(tensors, f"{p}.codes.{layer}"), spec.bits, shape)
        zero = tensors.get(f"{p}.zero")
        pieces.append(Piece(jnp.asarray(codes), jnp.asarray(tensors[f"{p}.scale"][layer]),
                            None if zero is None else jnp.asarray(zero[layer]),
                            jnp.asarray(tensors[f"{p}.smooth"][layer]), spec.bits, spec.act_bits))
        if pieces[-1].scale.shape[-2] != G:
          raise QuantError(f"{path}: {p} scale rows disagree")
      setattr(module, attr, Quantized(pieces, variable_names(weight), specs))
  except KeyError as e:
    raise QuantError(f"{path}/{WEIGHTS}: missing tensor {e}") from None
  model = _materialize(model)
  if mesh is not None:
    graphdef, state = nnx.split(model)
    model = nnx.merge(graphdef, place_variables(state, mesh))
  return model, config, plan


def _array(tensors, key, shape=None):
  a = tensors[key]
  if shape is not None and tuple(a.shape) != tuple(shape):
    raise QuantError(f"{key}: shape {tuple(a.shape)} in the file, {tuple(shape)} in the model")
  return a


def _materialize(model):
  """Every variable holding a concrete array (ShapeDtypeStructs of the abstract model are all replaced by now)."""
  leaves = jax.tree.leaves(nnx.state(model))
  if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
    raise QuantError("a parameter was not read from the file")
  return model
