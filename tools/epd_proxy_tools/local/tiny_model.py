"""Tiny checkpoints, built offline, for the local stack and e2e tests: a Qwen2-VL model (images
and video, ``--kind vision``) and a Qwen2-Audio model (``--kind audio``).

No weights can be downloaded here, and ``--load-format dummy`` is useless for
fidelity tests: its near-zero weights make every request answer the same text,
so a proxy that dropped or mixed up images would still "match" the baseline.
Large seeded random weights (std 0.3) make the greedy answer depend on the
image pixels, their order, the processing options and the RGBA background.

torch/transformers are imported inside functions only: the rest of the
package must stay importable without them.

The audio model is Qwen2-Audio's architecture (a Whisper-style encoder in front of a Qwen2
language model) with its Whisper feature extractor configured here, not downloaded. The window
stays Whisper's 30 s (vLLM 0.32 checks for 3000 mel frames), so a 1 s sound is 25 audio tokens.

    python -m epd_proxy_tools.local.tiny_model DEST [--kind vision|audio] [--seed N] [--force]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

# Bump whenever the produced files change, so stale folders get rebuilt.
BUILD_VERSION = 1
MARKER = ".epd-tiny-model.json"
SERVED_NAME = "tiny-vlm"
AUDIO_SERVED_NAME = "tiny-alm"
KINDS = ("vision", "audio")
WEIGHT_STD = 0.3

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Byte symbols take ids 0..255 in byte order, so "a" is 97 ... "z" is 122.
SPECIAL_IDS = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}
# The audio model's own specials, after the shared chat ones (ids 256..258 as above).
AUDIO_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|audio_bos|>",
    "<|AUDIO|>",
    "<|audio_eos|>",
)
AUDIO_SPECIAL_IDS = {tok: 256 + i for i, tok in enumerate(AUDIO_SPECIAL_TOKENS)}
# Whisper's front end as Qwen2-Audio has it: 16 kHz, a 30 s window of 3000 mel frames (vLLM's
# Qwen2AudioFeatureInputs insists on 3000), 25 audio tokens per second of sound.
AUDIO_SAMPLING_RATE = 16000
AUDIO_CHUNK_SECONDS = 30
AUDIO_MEL_BINS = 80
VOCAB_SIZE = 512
LOWERCASE_IDS = tuple(range(ord("a"), ord("z") + 1))

# Image sizes bounded so a 224x160 picture is 48 tokens and none exceeds 64.
IMAGE_SIZE = {"shortest_edge": 3136, "longest_edge": 50176}


# No whitespace control: the pieces are concatenated without stray spaces, and `{%-` would eat
# the newlines the format needs.
def _qwen_chat_template(counters: tuple[str, ...], media: str) -> str:
    """Qwen's chat layout around one model's media placeholders: `counters` name the numbering
    namespaces, `media` is the `{% if %}...{% elif %}` chain for one content part's media kinds."""
    return (
        "".join(f"{{% set {name} = namespace(value=0) %}}" for name in counters) + "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "{% endif %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}"
        "{{ message['content'] }}<|im_end|>\n"
        "{% else %}"
        "{% for content in message['content'] %}" + media + "{% elif 'text' in content %}"
        "{{ content['text'] }}"
        "{% endif %}"
        "{% endfor %}"
        "<|im_end|>\n"
        "{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


# Same structure as the Qwen2-VL template: default system prompt, one vision block per image/video
# part, optional "Picture N:" labels.
CHAT_TEMPLATE = _qwen_chat_template(
    ("image_count", "video_count"),
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>",
)


# Qwen2-Audio's layout: one "Audio N:" block per audio part, in content order.
AUDIO_CHAT_TEMPLATE = _qwen_chat_template(
    ("audio_count",),
    "{% if content['type'] == 'audio' or 'audio' in content or 'audio_url' in content %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n",
)


def _text_config(eos: int, bos: int) -> dict:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        # head size 32: the CPU attention backend rejects smaller heads
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "max_window_layers": 2,
        "rms_norm_eps": 1e-6,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "dtype": "bfloat16",
    }


def audio_config_dict() -> dict:
    ids = AUDIO_SPECIAL_IDS
    return {
        "architectures": ["Qwen2AudioForConditionalGeneration"],
        "model_type": "qwen2_audio",
        "dtype": "bfloat16",
        "audio_token_index": ids["<|AUDIO|>"],
        "audio_config": {
            "model_type": "qwen2_audio_encoder",
            "num_mel_bins": AUDIO_MEL_BINS,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 128,
            "d_model": 64,
            # the encoder insists on exactly max_source_positions * 2 mel frames
            "max_source_positions": AUDIO_CHUNK_SECONDS * AUDIO_SAMPLING_RATE // 160 // 2,
            "activation_function": "gelu",
        },
        "text_config": {
            "model_type": "qwen2",
            **_text_config(ids["<|im_end|>"], ids["<|endoftext|>"]),
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        },
        "tie_word_embeddings": False,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }


def config_dict() -> dict:
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "dtype": "bfloat16",
        "tie_word_embeddings": False,
        "image_token_id": SPECIAL_IDS["<|image_pad|>"],
        "video_token_id": SPECIAL_IDS["<|video_pad|>"],
        "vision_start_token_id": SPECIAL_IDS["<|vision_start|>"],
        "vision_end_token_id": SPECIAL_IDS["<|vision_end|>"],
        "bos_token_id": SPECIAL_IDS["<|endoftext|>"],
        "eos_token_id": SPECIAL_IDS["<|im_end|>"],
        "text_config": {
            "model_type": "qwen2_vl_text",
            **_text_config(eos=SPECIAL_IDS["<|im_end|>"], bos=SPECIAL_IDS["<|endoftext|>"]),
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000000.0,
                # sums to head_dim / 2 = 16
                "mrope_section": [4, 6, 6],
            },
        },
        "vision_config": {
            "model_type": "qwen2_vl_vision",
            "depth": 1,
            "embed_dim": 64,
            "hidden_size": 128,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
    }


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2 style reversible byte -> printable-character table; printable
    # ASCII maps to itself, which keeps "a".."z" readable in vocab.json.
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer(specials: tuple[str, ...] = SPECIAL_TOKENS, special_ids: dict[str, int] | None = None):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special_ids = SPECIAL_IDS if special_ids is None else special_ids

    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    bpe = models.BPE(vocab=vocab, merges=[])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # Registered on the raw tokenizer first so they get ids 256.. in order.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=list(specials),
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    # Special tokens must land on the ids the config names.
    for t, i in special_ids.items():
        got = fast.convert_tokens_to_ids(t)
        if got != i:
            raise RuntimeError(f"special token {t} got id {got}, expected {i}")
    return fast


def build_processor(tokenizer):
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    image_processor = Qwen2VLImageProcessor(size=dict(IMAGE_SIZE))
    video_processor = Qwen2VLVideoProcessor(size=dict(IMAGE_SIZE))
    return Qwen2VLProcessor(
        image_processor=image_processor,
        video_processor=video_processor,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
    )


def build_audio_processor(tokenizer):
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    features = WhisperFeatureExtractor(
        feature_size=AUDIO_MEL_BINS,
        sampling_rate=AUDIO_SAMPLING_RATE,
        hop_length=160,
        chunk_length=AUDIO_CHUNK_SECONDS,
        n_fft=400,
    )
    return Qwen2AudioProcessor(feature_extractor=features, tokenizer=tokenizer, chat_template=AUDIO_CHAT_TEMPLATE)


def build_weights(dest: Path, seed: int, kind: str = "vision") -> int:
    """Write model.safetensors + config.json; return the parameter count."""
    import torch

    if kind == "audio":
        from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

        config, model_cls = Qwen2AudioConfig(**audio_config_dict()), Qwen2AudioForConditionalGeneration
    else:
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        config, model_cls = Qwen2VLConfig(**config_dict()), Qwen2VLForConditionalGeneration
    torch.manual_seed(seed)
    model = model_cls(config)
    gen = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        # Deterministic order (by name) so the seed alone fixes the weights.
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * WEIGHT_STD)
            n += p.numel()
    model = model.to(torch.bfloat16)
    model.save_pretrained(dest, safe_serialization=True)
    if kind == "audio":
        _audio_checkpoint_names(dest / "model.safetensors")
    return n


def _audio_checkpoint_names(path: Path) -> None:
    """Rename the language model's weights to the published Qwen2-Audio checkpoints' layout, which
    vLLM 0.32 loads: transformers 5 saves them one `model.` deeper than it reads them back."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    renamed = {k.replace("language_model.model.model.", "language_model.model.", 1): v for k, v in tensors.items()}
    save_file(renamed, str(path), metadata={"format": "pt"})


def _marker_matches(dest: Path, seed: int, kind: str) -> bool:
    try:
        data = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    # Folders from before the audio model have no kind: they are the vision model.
    return data.get("version") == BUILD_VERSION and data.get("seed") == seed and data.get("kind", "vision") == kind


def build_tiny_model(dest: Path, seed: int = 0, force: bool = False, kind: str = "vision") -> Path:
    """Build (or reuse) the tiny model folder of `kind` at ``dest`` and return it."""
    if kind not in KINDS:
        raise ValueError(f"unknown tiny model kind {kind!r}; one of {', '.join(KINDS)}")
    dest = Path(dest).resolve()
    if not force and _marker_matches(dest, seed, kind):
        return dest
    # Importing the transformers model creates torch's inductor cache folder
    # (default /tmp/torchinductor_<user>); keep it in a scratch folder that we
    # delete, unless the caller already chose a location.
    scratch = None
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        scratch = dest.with_name(dest.name + ".scratch")
        scratch.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(scratch)
    try:
        return _build(dest, seed, kind)
    finally:
        if scratch is not None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
            shutil.rmtree(scratch, ignore_errors=True)


def _build(dest: Path, seed: int, kind: str) -> Path:
    t0 = time.monotonic()
    # Build next to dest then rename, so a crash never leaves a folder that
    # looks complete.
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if kind == "audio":
        ids = AUDIO_SPECIAL_IDS
        processor = build_audio_processor(build_tokenizer(AUDIO_SPECIAL_TOKENS, ids))
    else:
        ids = SPECIAL_IDS
        processor = build_processor(build_tokenizer())
    n_params = build_weights(tmp, seed, kind)
    processor.save_pretrained(tmp)
    # save_pretrained of the processor also writes the tokenizer, but keep
    # generation settings explicit for vLLM's default sampling params.
    (tmp / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": ids["<|endoftext|>"],
                "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
                "pad_token_id": ids["<|endoftext|>"],
            },
            indent=2,
        )
    )
    (tmp / MARKER).write_text(
        json.dumps(
            {
                "version": BUILD_VERSION,
                "kind": kind,
                "seed": seed,
                "std": WEIGHT_STD,
                "parameters": n_params,
                "build_seconds": round(time.monotonic() - t0, 2),
            },
            indent=2,
        )
    )
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


def build_lora_adapter(dest: Path, seed: int = 7, rank: int = 8) -> Path:
    """A PEFT LoRA adapter of the vision model's language layers (q_proj and v_proj), random and
    large enough to change its answers: what `vllm serve --enable-lora --lora-modules NAME=dest`
    loads. Built again each time; it takes milliseconds."""
    import torch
    from safetensors.torch import save_file

    text = config_dict()["text_config"]
    hidden, heads, kv_heads = text["hidden_size"], text["num_attention_heads"], text["num_key_value_heads"]
    outputs = {"q_proj": hidden, "v_proj": hidden // heads * kv_heads}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(text["num_hidden_layers"]):
        for proj, out in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[prefix + ".lora_A.weight"] = (torch.randn(rank, hidden, generator=gen) * 0.5).to(torch.bfloat16)
            tensors[prefix + ".lora_B.weight"] = (torch.randn(out, rank, generator=gen) * 0.5).to(torch.bfloat16)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank}
    config |= {"lora_dropout": 0.0, "target_modules": sorted(outputs), "bias": "none", "fan_in_fan_out": False}
    (dest / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m epd_proxy_tools.local.tiny_model",
        description="Build a tiny random-weight model folder offline: Qwen2-VL (vision) or Qwen2-Audio (audio).",
    )
    parser.add_argument("dest", type=Path)
    parser.add_argument("--kind", choices=KINDS, default="vision")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    out = build_tiny_model(args.dest, seed=args.seed, force=args.force, kind=args.kind)
    print(f"tiny model ready at {out} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
