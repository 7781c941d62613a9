"""Random-weight demo models that mlx-lm (and mlx-vlm) load: ``mlxd demo-model``.

A demo model is a real model directory (``config.json``, ``model.safetensors``,
a trained byte-level BPE tokenizer with a chat template) whose weights are
random. It lets the daemon, the tests and the benchmarks run the real MLX
engines with no network and no downloaded weights:

* ``tiny``: a 2-layer llama with hidden size 64, under 1 MB, a few hundred
  tokens per second on CPU; for tests.
* ``small``: about 25M parameters (hidden 512, 7 layers); for benchmarks.
* ``large``: 735M parameters, 2.7 GiB on disk (a llama of hidden 1,792, 16 layers,
  14 query heads of 128 and 2 KV heads, 32 KiB of KV a token; 27-41 s to write);
  the largest ``bench/agents.py`` can run on a 2-core, 24 GiB Linux box (below).
* ``vision``: a tiny LLaVA (llama text model, CLIP vision tower on 28 px
  images) that ``mlx_vlm.load`` reads; needs the ``vlm`` extra.

Weights are fp32: the MLX CPU backend is several times slower in fp16.
The embedding row of the end-of-sequence token is zero, so that the random
model almost never ends on its own and generations run to ``max_tokens``
(tests rely on long, deterministic greedy outputs). ``large`` also zeroes the
128 byte tokens that are part of a multi-byte character, so that every token it
generates is text (its random greedy output began with one, which a server
streams as an empty chunk: no first token for the bench to time).

Why ``large`` is that size (measured with bare mlx-lm on OpenBLAS, the box
shared with other work; a quiet box runs a 4,000-token prefill in about the
CPU time over 2.2, as the small model's 1,774 tokens do: 5 CPU-s, 2.3 s quiet).
The agents bench keeps four processes resident at once (mlxd, mlx_lm.server,
vllm-mlx and bare mlx-lm) and a 32k-token prefill's attention holds a score
matrix of query heads x 2,048 x 32,768 fp32 (256 MiB a head: 3.5 GiB here), so
4 x weights + that + the 32k KV (1 GiB) + three servers' cached prompts must fit
in ~20 GiB: 735M (4 x 2.7 GiB) does, with ~19 GiB; a 1B llama (3.6 GiB) does
not (~23 GiB). Time: a cold 4,000-token prefill took 135 CPU-s (~60 s quiet; 171 s
on the loaded box, peak RSS 3.6 GiB) against 554M's 87 s and 974M's 276 s
(32 heads of 64) on the same loaded box; head size 128 matters on CPU (a 32k
chunk's attention ran 3x faster than with 32 heads of 64). A round of the default
bench costs about 30 cold 4k prefills (~30 minutes at ~60 s): a smaller model
would shorten it, a larger one does not fit.

MLX work runs on the caller's thread; the engines call :func:`write_demo_model`
on their own MLX thread (demo on first use), the CLI on the main thread.
"""

from __future__ import annotations

import importlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

DemoKind = Literal["tiny", "small", "large", "vision", "embedding"]
KINDS: tuple[str, ...] = ("tiny", "small", "large", "vision", "embedding")

#: the text model shape of each kind (llama)
TEXT_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        # long prompts (an agent's first request is 15-60k tokens) fit; 1 KiB of KV a token
        max_position_embeddings=65536,
    ),
    "small": dict(
        hidden_size=512,
        num_hidden_layers=7,
        intermediate_size=1536,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=32768,
    ),
    # the same tokenizer and template as small (a prompt tokenizes the same); GQA and
    # 128-wide heads as current small llamas; 65,536 positions: a 32k prompt and its template fit
    "large": dict(
        hidden_size=1792,
        num_hidden_layers=16,
        intermediate_size=7168,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=65536,
    ),
}
#: text kinds whose every token is whole characters (byte tokens of a partial UTF-8
#: character are never generated): ``large``'s random greedy output began with one
WHOLE_CHARACTERS = ("large",)
VOCAB_SIZE = {"tiny": 512, "small": 512, "large": 512, "vision": 512, "embedding": 512}
#: the BERT of ``embedding`` (mlx-embeddings); 128 positions keep the context check testable
BERT_SHAPE: dict[str, Any] = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64,
                                  intermediate_size=128, max_position_embeddings=128)

#: the markers of a tool call in the text (mlx-lm's ``json_tools`` family: Hermes / Qwen 2.5)
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_MARKERS = (TOOL_CALL_START, TOOL_CALL_END, "<tool_response>", "</tool_response>")

#: renders plain-string contents (text models) and content-part lists (LLaVA) alike.
#: With ``tools``: a system line listing them, assistant ``tool_calls`` as
#: ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` and tool results as
#: ``<tool_response>...</tool_response>`` -- the format whose markers and parser
#: mlx-lm infers from the template (``json_tools``).
CHAT_TEMPLATE = (
    "{% if tools %}system: you may call these functions; answer with "
    "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>\n<tools>"
    "{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['role'] == 'tool' %}<tool_response>{{ m['content'] }}</tool_response>"
    "{% elif m['content'] is string %}{{ m['content'] }}"
    "{% elif m['content'] %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% for tool_call in m['tool_calls'] or [] %}"
    "{% if tool_call['function'] is defined %}{% set tool_call = tool_call['function'] %}{% endif %}"
    "<tool_call>{\"name\": {{ tool_call.name | tojson }}, \"arguments\": "
    "{{ tool_call.arguments | tojson }}}</tool_call>{% endfor %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)

#: the template of a model without tool support (``mlxd demo-model --no-tools``)
PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<image>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)

_CORPUS = [
    "hello world this is a tiny model for testing mlxd, an always on daemon serving mlx models.",
    "the quick brown fox jumps over the lazy dog while the scheduler keeps models resident.",
    "memory budgets, leases, journals and preemption: every transition is written down.",
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen.",
    "Models load, generate tokens, and unload again; the residency manager decides which stay.",
    "A user asks a question and the assistant answers with random words from its vocabulary.",
]

Report = Callable[[str], None]


class DemoModelError(Exception):
    """Bad input for the demo model writer (the CLI exits 2 with its message)."""


def _train_tokenizer(vocab_size: int, *, vision: bool, tools: bool = True) -> Any:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<image>"] if vision else ["<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([line * 3 for line in _CORPUS] * 40, trainer)
    if tools:  # one token each, not special: they are text the tool parser reads
        tok.add_tokens([AddedToken(m, special=False, normalized=False) for m in TOOL_MARKERS])
    extra: dict[str, Any] = {"extra_special_tokens": {"image_token": "<image>"}} if vision else {}
    make_fast: Any = PreTrainedTokenizerFast
    fast = make_fast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", **extra)
    fast.chat_template = CHAT_TEMPLATE if tools else PLAIN_CHAT_TEMPLATE
    return fast


def _random_params(
    model: Any, eos_id: int, embed_keys: tuple[str, ...], also_zero: tuple[int, ...] = ()
) -> dict[str, Any]:
    """The model's random parameters in fp32, the embedding rows of ``eos_id`` and
    ``also_zero`` zero (tied: their logit is 0, which the largest of ~500 random logits
    almost always beats, so greedy decoding avoids them)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    flat: Any = tree_flatten(model.parameters())
    params = {leaf[0]: leaf[1].astype(mx.float32) for leaf in flat}
    for key in embed_keys:
        if key in params:
            w = params[key]
            for row in sorted({eos_id, *also_zero}):
                w = mx.concatenate([w[:row], mx.zeros_like(w[row : row + 1]), w[row + 1 :]])
            params[key] = w
    mx.eval(params)
    return params


def text_config(size: str, fast: Any) -> dict[str, Any]:
    """The llama ``config.json`` of the text kind ``size`` with the tokenizer ``fast``."""
    return dict(
        model_type="llama",
        rms_norm_eps=1e-5,
        vocab_size=len(fast),
        tie_word_embeddings=True,
        bos_token_id=fast.convert_tokens_to_ids("<s>"),
        eos_token_id=fast.convert_tokens_to_ids("</s>"),
        torch_dtype="float32",
        **TEXT_SHAPES[size],
    )


def _write_text(out: Path, size: str, seed: int, report: Report, *, tools: bool = True) -> int:
    import mlx.core as mx

    llama: Any = importlib.import_module("mlx_lm.models.llama")

    report(f"training a {VOCAB_SIZE[size]}-token BPE tokenizer")
    fast = _train_tokenizer(VOCAB_SIZE[size], vision=False, tools=tools)
    fast.save_pretrained(str(out))
    cfg = text_config(size, fast)
    eos = cfg["eos_token_id"]
    report(f"writing random fp32 llama weights ({size})")
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    # a token that is part of a character streams as nothing (a server's first chunk would
    # carry no text): large never picks one; tiny and small stay as their results were made
    partial = (tuple(i for i in range(len(fast)) if "\ufffd" in fast.decode([i]))
               if size in WHOLE_CHARACTERS else ())  # fmt: skip
    params = _random_params(model, eos, ("model.embed_tokens.weight",), partial)
    mx.save_safetensors(str(out / "model.safetensors"), params)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return sum(int(v.size) for v in params.values())


def _write_vision(out: Path, seed: int, report: Report) -> int:
    import mlx.core as mx
    from transformers import CLIPImageProcessor, LlavaProcessor

    try:
        llava: Any = importlib.import_module("mlx_vlm.models.llava")
    except ImportError as e:  # the vlm extra is optional
        raise DemoModelError(f"--vision needs the vlm extra (pip install 'mlxd[vlm]'): {e}") from e

    report("training a 512-token BPE tokenizer with an <image> token")
    fast = _train_tokenizer(VOCAB_SIZE["vision"], vision=True, tools=False)
    vocab = len(fast)
    eos = fast.convert_tokens_to_ids("</s>")
    ip = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    make_processor: Any = LlavaProcessor
    make_processor(
        image_processor=ip,
        tokenizer=fast,
        patch_size=14,
        vision_feature_select_strategy="default",
        chat_template=CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    ).save_pretrained(str(out))
    text = dict(model_type="llama", rms_norm_eps=1e-5, vocab_size=vocab, **TEXT_SHAPES["tiny"])
    cfg = {
        "model_type": "llava",
        "image_token_index": fast.convert_tokens_to_ids("<image>"),
        "vocab_size": vocab,
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "eos_token_id": [eos],
        "torch_dtype": "float32",
        "text_config": text,
        "vision_config": {
            "model_type": "clip_vision_model",
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
            "projection_dim": 32,
            "num_channels": 3,
            "layer_norm_eps": 1e-5,
        },
    }
    report("writing random fp32 LLaVA weights")
    mx.random.seed(seed)
    mc = llava.ModelConfig.from_dict(cfg)
    mc.text_config = llava.TextConfig.from_dict(cfg["text_config"])
    mc.vision_config = llava.VisionConfig.from_dict(cfg["vision_config"])
    model = llava.Model(mc)
    params = _random_params(
        model,
        eos,
        ("language_model.model.embed_tokens.weight", "language_model.lm_head.weight"),
    )
    mx.save_safetensors(str(out / "model.safetensors"), params)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return sum(int(v.size) for v in params.values())


def _write_embedding(out: Path, seed: int, report: Report) -> int:
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    try:
        bert: Any = importlib.import_module("mlx_embeddings.models.bert")
    except ImportError as e:  # the embeddings extra is optional
        raise DemoModelError(f"--embedding needs the embeddings extra (pip install 'mlxd[embeddings]'): {e}") from e
    report("training a 512-token WordPiece tokenizer")
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    trainer = trainers.WordPieceTrainer(vocab_size=VOCAB_SIZE["embedding"], special_tokens=specials,
                                        show_progress=False)
    tok.train_from_iterator([line * 3 for line in _CORPUS] * 40, trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    make_fast: Any = PreTrainedTokenizerFast
    fast = make_fast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                     sep_token="[SEP]", mask_token="[MASK]",
                     model_max_length=BERT_SHAPE["max_position_embeddings"])
    fast.save_pretrained(str(out))
    cfg = dict(model_type="bert", architectures=["BertModel"], vocab_size=len(fast),
               type_vocab_size=2, layer_norm_eps=1e-12, torch_dtype="float32", **BERT_SHAPE)
    report("writing random fp32 BERT weights")
    mx.random.seed(seed)
    model = bert.Model(bert.ModelArgs.from_dict(cfg))
    flat: Any = tree_flatten(model.parameters())
    params = {k: v.astype(mx.float32) for k, v in flat}
    mx.save_safetensors(str(out / "model.safetensors"), params)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return sum(int(v.size) for v in params.values())


def is_model_dir(path: Path) -> bool:
    """True if ``path`` holds a model (has a ``config.json``)."""
    return (path / "config.json").is_file()


def write_demo_model(
    path: str | Path,
    kind: DemoKind = "tiny",
    *,
    force: bool = False,
    seed: int = 0,
    report: Report | None = None,
    tools: bool = True,
) -> int:
    """Write a demo model of ``kind`` into ``path``; return its parameter count.

    Text models get a chat template with tool support (the markers and the
    ``json_tools`` format of :data:`CHAT_TEMPLATE`) unless ``tools`` is false.

    Refuses (:class:`DemoModelError`) to write into a non-empty directory unless
    ``force``. The files are written into a sibling temporary directory and
    moved into place at the end, so a crash never leaves a half model behind
    that :func:`is_model_dir` would accept.
    """
    if kind not in KINDS:
        raise DemoModelError(
            f"unknown demo model kind {kind!r} (expected one of {', '.join(KINDS)})"
        )
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise DemoModelError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise DemoModelError(f"{out} is not empty (use --force to overwrite)")
    say = report or (lambda _msg: None)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        if kind == "vision":
            n = _write_vision(tmp, seed, say)
        elif kind == "embedding":
            n = _write_embedding(tmp, seed, say)
        else:
            n = _write_text(tmp, kind, seed, say, tools=tools)
        (tmp / "README.md").write_text(
            f"# mlxd demo model ({kind})\n\nRandom fp32 weights ({n:,} parameters) written by "
            "`mlxd demo-model`; its output is gibberish by design.\n"
        )
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    say(f"wrote {out} ({n:,} parameters)")
    return n


