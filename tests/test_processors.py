"""Chat requests as the family's own processor makes them, checked against Hugging Face: for each
VLM family whose Processor builds offline, a folder saved by `save_pretrained` (weights, a
tokenizer with the family's chat template, the Processor itself), and `model=hf
model.checkpoint=<folder>` with a mixed batch (text, one image, two images). The prompt ids and
the greedy tokens equal `AutoProcessor` + `apply_chat_template` + `generate` on the same folder,
each request alone, with capture=none and with capture=partial."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import save_checkpoint
from conftest import build_tiny, compose_cfg, compose_dict, staged
from PIL import Image
from test_checkpoints import hydra_value

from pipeline.errors import ConfigError
from pipeline.jobs import check_config
from pipeline.models import meta, zoo
from pipeline.models.families import family_processor
from pipeline.models.images import default_image_size, synthetic_image
from pipeline.models.processor import forward_names, processed
from pipeline.runtime.engine import DemoLLM
from pipeline.runtime.requests import build_requests, sources_of
from pipeline.runtime.sampling import SamplingParams

# Families whose whole Processor a folder carries (tests/checkpoints.py, models/families.py)
PROCESSOR_FAMILIES = [
    "tiny_mistral3",
    "tiny_qwen2_5_vl",
    "tiny_qwen2_vl",
    "tiny_qwen3_vl",
    "tiny_idefics3",
    "tiny_aya_vision",
    "tiny_mllama",
    "tiny_llava",
    "tiny_llava_next",
    "tiny_vipllava",
    "tiny_gemma3",
    "tiny_internvl",
    "tiny_glm4v",
    "tiny_llava_onevision",
    "tiny_paligemma",
    "tiny_deepseek_vl",
    "tiny_paddleocr_vl",
    "tiny_llama4_scout",
    "tiny_smolvlm",
    "tiny_qwen3_vl_moe",
    "tiny_llava_next_video",
    "tiny_video_llava",
    "tiny_glm46v",
    "tiny_glm4v_moe",
    "tiny_lighton_ocr",
    "tiny_cohere2_vision",
    "tiny_idefics2",
    "tiny_aria",
    "tiny_ovis2",
    "tiny_lfm2_vl",
    "tiny_deepseek_vl_hybrid",
    "tiny_fuyu",
    "tiny_blip2",
    "tiny_kosmos2",
    "tiny_chameleon",
    "tiny_ernie4_5_vl_moe",
    "tiny_got_ocr2",
]
# Families whose processor (PaliGemma's, GOT-OCR2's) or generate (BLIP-2's) refuses a text without
# images: their batch is the image requests
NEEDS_IMAGES = {"tiny_paligemma", "tiny_blip2", "tiny_got_ocr2"}
# Processors that take one image a prompt (Fuyu's and Kosmos-2's put it first, BLIP-2's writes one
# image's query tokens): their batch has no two-image request
ONE_IMAGE = {"tiny_fuyu", "tiny_blip2", "tiny_kosmos2"}
# A folder's config beside its YAML's, where the family's Processor writes a count it does not save:
# GOT-OCR2's writes 256 image tokens an image, so its folder's vision tower takes 64 x 64 patches
# (windowed attention only: a global layer over 4096 patches would take most of its time), which
# the projector downsamples to 16 x 16 (its YAML's workload takes 1 token an image)
FOLDER_OVERRIDES = {
    "tiny_got_ocr2": [
        "model.hf_config.vision_config.patch_size=1",
        "model.hf_config.vision_config.window_size=8",
        "model.hf_config.vision_config.global_attn_indexes=[]",
    ]
}
# Families whose language model only runs eager: captured, they are refused up front, naming why
# (LFM2's convolution layers keep a state the paged KV cache does not; captured, its tokens drifted)
EAGER_ONLY = {"tiny_lfm2_vl": "has conv layers"}
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> list:
    root = tmp_path_factory.mktemp("pictures")
    paths = []
    for index, (height, width) in enumerate([(60, 90), (70, 40)]):
        generator = torch.Generator().manual_seed(index)
        pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
        paths.append(root / f"picture{index}.png")
        Image.fromarray(pixels.numpy()).save(paths[-1])
    return paths


def _mixed_batch(pictures) -> list:
    """Chat messages: text alone, one image, two images."""

    def image(path):
        return {"type": "image", "url": f"file://{path}"}

    def text(words):
        return {"type": "text", "text": words}

    return [
        [{"role": "user", "content": [text("how big is the universe?")]}],
        [{"role": "user", "content": [text("please describe this image"), image(pictures[0])]}],
        [{"role": "user", "content": [image(pictures[0]), text("compare this image"), image(pictures[1])]}],
    ]


def _hugging_face(folder, messages: list, model_cls) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy tokens) of each chat alone, as Hugging Face's processor and generate make them."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    # FuyuProcessor reloads without the folder's chat_template.jinja: its tokenizer holds it
    processor.chat_template = processor.chat_template or processor.tokenizer.chat_template
    model = model_cls.from_pretrained(folder, local_files_only=True).eval()
    out = []
    for chat in messages:
        text = processor.apply_chat_template(chat, add_generation_prompt=True)
        paths = [
            part["url"].removeprefix("file://") for part in chat[0]["content"] if part["type"] == "image"
        ]
        images = [Image.open(p).convert("RGB") for p in paths] or None
        # pixels in the model's dtype, as HF's examples cast them (Llama 4's processor gives bfloat16)
        inputs = processor(text=[text], images=images, return_tensors="pt").to(model.dtype)
        with torch.no_grad():
            ids = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)[0]
        prompt = inputs["input_ids"][0].tolist()
        out.append((prompt, ids[len(prompt) :].tolist()))
    return out


@pytest.fixture(scope="module")
def hf_tokens() -> dict:
    """Hugging Face's (prompt ids, tokens) per family, made once for both capture modes."""
    return {}


class _Folders(dict):
    """Each family's folder, saved when a test first asks for it (a worker runs some families)."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, name):
        model = build_tiny(name, seed=5, overrides=FOLDER_OVERRIDES.get(name, ()))[0]
        self[name] = save_checkpoint(model, self.root / name)
        return self[name]


@pytest.fixture(scope="module")
def processor_folders(tmp_path_factory) -> dict:
    return _Folders(tmp_path_factory.mktemp("processor_folders"))


def _folder_queries(folder, messages: list, capture: str) -> list[str]:
    """The overrides of a run of the folder on these chats, as a user writes them."""
    return [
        "model=hf",
        f"model.checkpoint={folder}",
        f"prompt.queries={hydra_value(messages)}",
        f"prompt.output_len={NEW_TOKENS}",
        f"capture={capture}",
    ]


@pytest.mark.parametrize("capture", ["none", "partial"])
@pytest.mark.parametrize("name", PROCESSOR_FAMILIES)
def test_a_mixed_batch_is_what_the_familys_processor_and_generate_make(
    name, capture, processor_folders, pictures, hf_tokens, tmp_path
):
    folder = processor_folders[name]
    messages = _mixed_batch(pictures)[1 if name in NEEDS_IMAGES else 0 : 2 if name in ONE_IMAGE else 3]
    overrides = _folder_queries(folder, messages, capture)
    if capture != "none" and name in EAGER_ONLY:
        with pytest.raises(ConfigError, match=EAGER_ONLY[name]):
            check_config(compose_dict(overrides), cuda_available=False)
        return
    checked = check_config(compose_dict(overrides), cuda_available=False)
    if name not in hf_tokens:
        hf_tokens[name] = _hugging_face(folder, messages, checked.model_cls)
    want = hf_tokens[name]
    with staged(overrides, "transforms", tmp_path) as state:
        assert state.sources.processor is not None, "the folder's processor was not loaded"
        cfg = state.cfg
        requests = build_requests(
            cfg.prompt, cfg.runtime, cfg.seed, state.hf_config, torch.float32, state.device, state.sources,
            chunked=capture != "none",
        )  # fmt: skip
        assert [r.prompt for r in requests] == [prompt for prompt, _ in want]
        engine = DemoLLM(
            state.model, state.hf_config, cfg.runtime, state.device, zoo.eos_ids(state.hf_config)
        )
        tokens = engine.generate(requests, NEW_TOKENS, SamplingParams(), seed=0).tokens
    assert [tokens[r.seq_id] for r in requests] == [generated for _, generated in want]


@pytest.mark.parametrize("capture", ["none", "partial"])
def test_a_text_request_runs_where_the_forward_takes_images_every_call(
    capture, processor_folders, pictures, tmp_path
):
    """BLIP-2's forward takes pixel_values on every call and its generate nothing else, so Hugging
    Face runs no text request of it: the pipeline does (its forward given no image features), and
    the ids are the folder's processor's, the tokens those of the folder's OPT language model
    generating from them."""
    from transformers import AutoProcessor, Blip2ForConditionalGeneration

    folder = processor_folders["tiny_blip2"]
    messages = _mixed_batch(pictures)[:1]
    overrides = _folder_queries(folder, messages, capture)
    with staged(overrides, "transforms", tmp_path) as state:
        cfg = state.cfg
        (request,) = build_requests(
            cfg.prompt, cfg.runtime, cfg.seed, state.hf_config, torch.float32, state.device, state.sources,
            chunked=capture != "none",
        )  # fmt: skip
        engine = DemoLLM(
            state.model, state.hf_config, cfg.runtime, state.device, zoo.eos_ids(state.hf_config)
        )
        tokens = engine.generate([request], NEW_TOKENS, SamplingParams(), seed=0).tokens[request.seq_id]
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    processor.chat_template = processor.chat_template or processor.tokenizer.chat_template  # as Fuyu's
    ids = processor(
        text=[processor.apply_chat_template(messages[0], add_generation_prompt=True)], return_tensors="pt"
    )
    assert request.prompt == ids["input_ids"][0].tolist()
    language_model = Blip2ForConditionalGeneration.from_pretrained(
        folder, local_files_only=True
    ).language_model
    with torch.no_grad():
        want = language_model.eval().generate(**ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0]
    assert tokens == want[len(request.prompt) :].tolist()


def test_masked_image_places_of_requests_of_two_lengths_line_up_in_one_wave(
    processor_folders, pictures, hf_tokens, tmp_path
):
    """capture=none prefills a wave of whole prompts left-padded to the longest: Kosmos-2's image
    mask is padded with its ids, so the shorter image request's features land on its own places
    (the tokens equal Hugging Face's for each request alone)."""
    folder = processor_folders["tiny_kosmos2"]
    picture = {"type": "image", "url": f"file://{pictures[1]}"}
    messages = [
        [{"role": "user", "content": [picture, {"type": "text", "text": "what colour"}]}],
        [
            {
                "role": "user",
                "content": [picture, {"type": "text", "text": "tell me about the sky and water " * 3}],
            }
        ],
    ]
    overrides = _folder_queries(folder, messages, "none")
    checked = check_config(compose_dict(overrides), cuda_available=False)
    want = _hugging_face(folder, messages, checked.model_cls)
    with staged(overrides, "transforms", tmp_path) as state:
        cfg = state.cfg
        requests = build_requests(
            cfg.prompt, cfg.runtime, cfg.seed, state.hf_config, torch.float32, state.device, state.sources,
            chunked=False,
        )  # fmt: skip
        assert len(requests[0].prompt) < len(requests[1].prompt)
        engine = DemoLLM(
            state.model, state.hf_config, cfg.runtime, state.device, zoo.eos_ids(state.hf_config)
        )
        tokens = engine.generate(requests, NEW_TOKENS, SamplingParams(), seed=0).tokens
    assert [tokens[r.seq_id] for r in requests] == [generated for _, generated in want]


class _Returns:
    """A processor that returns one more per-token tensor than its family's."""

    def __init__(self, processor, key):
        self.processor, self.key = processor, key
        self.image_token, self.tokenizer = processor.image_token, processor.tokenizer

    def __call__(self, **kwargs):
        out = self.processor(**kwargs)
        out[self.key] = torch.ones_like(out["input_ids"])
        return out


def test_a_per_token_output_the_graph_cannot_take_is_refused_naming_it(processor_folders, pictures):
    """Qwen2.5-VL's forward names mm_token_type_ids (its grid positions, which the runtime carries)
    and position_ids, which the runtime makes itself: a processor returning position ids is a
    config error naming the output and the family, not a tensor dropped."""
    folder = processor_folders["tiny_qwen2_5_vl"]
    checked = check_config(compose_dict(["model=hf", f"model.checkpoint={folder}"]), cuda_available=False)
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    skeleton = meta.meta_model(checked.model_cls, checked.hf_config)
    chat = _mixed_batch(pictures)[1]
    text = processor.apply_chat_template(chat, add_generation_prompt=True)
    image = [Image.open(pictures[0]).convert("RGB")]
    cpu = torch.device("cpu")
    ids, pixels, per_token, spans = processed(
        processor, checked.hf_config, text, image, skeleton, torch.float32, cpu
    )
    assert set(per_token) == {"mm_token_type_ids"} and set(pixels) == {"pixel_values", "image_grid_thw"}
    assert json.dumps(per_token["mm_token_type_ids"].tolist()) == json.dumps(
        [int(t == checked.hf_config.image_token_id) for t in ids]
    )
    assert spans and spans[0][1] - spans[0][0] == sum(t == checked.hf_config.image_token_id for t in ids)
    with pytest.raises(ConfigError, match=r"returns position_ids \[1, \d+\].*model_type=qwen2_5_vl"):
        processed(
            _Returns(processor, "position_ids"), checked.hf_config, text, image, skeleton, torch.float32, cpu
        )


def test_a_request_the_familys_processor_refuses_is_a_config_error(processor_folders, pictures):
    """Fuyu's processor puts one image first in a prompt: a chat with two images is refused before
    load, naming the processor and why, as Hugging Face's processor refuses it."""
    messages = _mixed_batch(pictures)[2:]
    folder = processor_folders["tiny_fuyu"]
    overrides = ["model=hf", f"model.checkpoint={folder}", f"prompt.queries={hydra_value(messages)}"]
    with pytest.raises(
        ConfigError, match=r"FuyuProcessor cannot make this request of 2 image\(s\): .*images"
    ):
        check_config(compose_dict(overrides), cuda_available=False)


def test_a_vlm_with_neither_image_token_nor_known_mask_is_refused_before_load(tmp_path):
    """A BLIP-2 config without image_token_index (as folders saved before transformers gave BLIP-2
    one): where its image features go is neither a token nor a mask the pipeline lays out
    (models/image_mask.py), so a one-line config error names the model type, not an
    AttributeError at load."""
    from transformers import Blip2Config

    cfg = compose_cfg(["model=tiny_blip2"])
    config = zoo.build_hf_config(cfg.model)
    config = Blip2Config(
        vision_config=config.vision_config.to_dict(),
        qformer_config=config.qformer_config.to_dict(),
        text_config=config.text_config.to_dict(),
        num_query_tokens=4,
    )
    config.architectures = ["Blip2ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    overrides = ["model=hf", f"model.checkpoint={tmp_path}", "model.skip_loading_weights=true"]
    with pytest.raises(
        ConfigError, match=r"^model_type=blip-2 names no image token .* by a mask \(kosmos-2\)"
    ):
        check_config(compose_dict(overrides), cuda_available=False)


def test_image_places_are_read_from_the_familys_mask(processor_folders, pictures):
    """Kosmos-2's processor writes an image's places as ordinary ids and marks them in
    image_embeds_position_mask: the request's image span is the mask's run of 1s, the mask itself
    rides with the request, and the pixels are the processor's."""
    from transformers import AutoProcessor

    folder = processor_folders["tiny_kosmos2"]
    checked = check_config(compose_dict(["model=hf", f"model.checkpoint={folder}"]), cuda_available=False)
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    processor.chat_template = processor.tokenizer.chat_template  # as Fuyu's, saved with its tokenizer
    skeleton = meta.meta_model(checked.model_cls, checked.hf_config)
    text = processor.apply_chat_template(_mixed_batch(pictures)[1], add_generation_prompt=True)
    image = [Image.open(pictures[0]).convert("RGB")]
    made = processor(text=[text], images=image, return_tensors="pt")
    ids, pixels, per_token, spans = processed(
        processor, checked.hf_config, text, image, skeleton, torch.float32, torch.device("cpu")
    )
    mask = made["image_embeds_position_mask"][0]
    assert ids == made["input_ids"][0].tolist() and torch.equal(per_token["image_embeds_position_mask"], mask)
    start = int(mask.argmax())
    assert spans == [(start, start + checked.hf_config.latent_query_num)] and mask.sum() == 64
    assert torch.equal(pixels["pixel_values"], made["pixel_values"])


def test_a_processor_that_cannot_be_built_is_said_and_the_pipelines_layout_taken(
    processor_folders, caplog, tmp_path
):
    """A folder whose processor config names a class this transformers lacks: AutoProcessor gives
    the tokenizer alone, and a WARNING says the processor cannot be built and that chat images take
    the pipeline's layout, rather than the folder's processor being passed over in silence."""
    import shutil

    from pipeline.models.processor import load_processor
    from pipeline.models.tokenizer import load_tokenizer

    folder = shutil.copytree(processor_folders["tiny_qwen2_5_vl"], tmp_path / "qwen")
    settings = json.loads((folder / "processor_config.json").read_text())
    (folder / "processor_config.json").write_text(
        json.dumps({**settings, "processor_class": "NoSuchProcessor"})
    )
    tokenizer = load_tokenizer(str(folder))
    with caplog.at_level("WARNING", logger="pipeline.models.processor"):
        assert load_processor(str(folder), tokenizer) is None
    assert "cannot be built here" in caplog.text and "TokenizersBackend" in caplog.text
    assert "laid out by the pipeline's rules" in caplog.text
    assert load_processor(str(processor_folders["tiny_qwen2_5_vl"]), tokenizer) is not None


def _synthetic(name: str, overrides=()):
    """(config, hf_config, sources, the first request) of a YAML model's generated workload."""
    cfg = compose_cfg([f"model={name}", *overrides])
    hf_config = zoo.build_hf_config(cfg.model)
    skeleton = meta.meta_model(zoo.resolve_model_class(cfg.model, hf_config), hf_config)
    sources = sources_of(None, hf_config, skeleton, cfg.prompt.image_layout)
    requests = build_requests(
        cfg.prompt, cfg.runtime, cfg.seed, hf_config, torch.float32, torch.device("cpu"), sources
    )
    return cfg, hf_config, sources, requests[0]


@pytest.mark.parametrize("name", PROCESSOR_FAMILIES)
def test_the_default_image_request_is_a_chat_turn_the_familys_processor_makes(name):
    """A YAML-only VLM's generated workload: its image request is what the family's Processor
    (Hugging Face's class, with a tokenizer and settings made for the config) makes of a user turn
    holding the image and random text. Around the text, the ids are the Processor's (the chat turn,
    begin/end markers, tiles, row markers, image tokens); the pixels and per-token tensors are its
    own; the prompt is prompt.prompt_len long."""
    cfg, hf_config, sources, request = _synthetic(name)
    assert "prompt.image_layout=family" in sources.layout
    image = synthetic_image(default_image_size(hf_config), torch.Generator().manual_seed(cfg.seed))
    processor = family_processor(hf_config)
    # the turn with a one-token text ("a"; a SentencePiece tokenizer's `▁` goes with it), split where
    # the request's text stands
    turn = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "a"}]}]
    made = processor(
        text=[processor.apply_chat_template(turn, add_generation_prompt=True)],
        images=[image],
        return_tensors="pt",
    )
    frame, prompt = made["input_ids"][0].tolist(), request.prompt
    cut = next(
        k
        for k in range(len(frame))
        if prompt[:k] == frame[:k] and prompt[len(prompt) - len(frame) + k + 1 :] == frame[k + 1 :]
    )
    assert len(prompt) == cfg.prompt.prompt_len
    assert all(end <= cut for _, end in request.image_spans)
    names = forward_names(sources.skeleton)  # a deprecated name as the forward renames it
    made = {names.get(key, key): value for key, value in made.items()}
    for key, value in request.images.items():
        assert torch.equal(value, made[key].to(value.dtype)), key
    for key, value in request.token_inputs.items():
        assert torch.equal(value[:cut], made[key][0][:cut]), key


def test_the_generic_layout_of_a_family_without_an_image_token_is_refused():
    """The generic layout writes the config's image token, which Kosmos-2 has not (its processor
    marks image places by a mask): prompt.image_layout=generic is a config error saying to take
    the family's layout, not a request of None ids."""
    with pytest.raises(
        ConfigError, match=r"model_type=kosmos-2 marks image positions by a mask.*image_layout=family"
    ):
        _synthetic("tiny_kosmos2", ["prompt.image_layout=generic"])


def test_a_vq_familys_image_tokens_are_counted_from_its_config_not_a_meta_model():
    """Chameleon's VQ-GAN lives inside the language model, which the meta-device skeleton leaves
    without memory: the generic layout counts an image's codes from the VQ config (resolution over
    the encoder's downsampling, squared), and that is what the VQ-GAN makes of the image on real
    weights and what the family's Processor writes."""
    from pipeline.models import build

    cfg, hf_config, _, request = _synthetic("tiny_chameleon", ["prompt.image_layout=generic"])
    ((start, end),) = request.image_spans
    assert request.prompt[start:end] == [hf_config.image_token_id] * (end - start)
    model, _ = build.build_random(
        zoo.resolve_model_class(cfg.model, hf_config), hf_config, torch.float32, torch.device("cpu"), 0
    )
    codes = model.model.get_image_tokens(request.images["pixel_values"])
    assert codes.shape == (1, end - start) and family_processor(hf_config).image_seq_length == end - start


def test_the_branch_free_vision_experts_compute_what_hugging_faces_layer_does():
    """ERNIE-4.5-VL's MoE layer, given tokens of both modalities (and of text alone): the forward
    the pipeline gives it (every token through both sets of experts, each keeping its modality's)
    returns Hugging Face's hidden states for every token."""
    from pipeline.models import build, vision_experts

    cfg = compose_cfg(["model=tiny_ernie4_5_vl_moe"])
    hf_config = zoo.build_hf_config(cfg.model)
    model, _ = build.build_random(
        zoo.resolve_model_class(cfg.model, hf_config), hf_config, torch.float32, torch.device("cpu"), 0
    )
    layer = next(m for m in model.modules() if hasattr(m, "vision_moe"))
    hidden = torch.randn(2, 7, hf_config.text_config.hidden_size, generator=torch.Generator().manual_seed(0))
    types = torch.tensor([[0, 1, 1, 1, 0, 0, 1], [1, 0, 0, 0, 0, 0, 0]])
    with torch.no_grad():
        want = [layer(hidden, types)[0], layer(hidden, None)[0]]
        vision_experts.prepare(model)
        got = [layer(hidden, types)[0], layer(hidden, None)[0]]
    for ours, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(want[0], want[1])  # the vision experts change what they compute


def test_a_deprecated_forward_name_is_given_its_new_name():
    """FuyuProcessor returns `image_patches`, a name FuyuForCausalLM.forward takes only through
    transformers' deprecate_kwarg wrapper: it reaches the forward as `pixel_values`, and a name the
    forward takes as it is stays itself."""
    cfg = compose_cfg(["model=tiny_fuyu"])
    hf_config = zoo.build_hf_config(cfg.model)
    names = forward_names(meta.meta_model(zoo.resolve_model_class(cfg.model, hf_config), hf_config))
    assert names["image_patches"] == "pixel_values" and names["input_ids"] == "input_ids"
    assert "kwargs" not in names


def test_a_byte_level_bpe_folders_requests_are_prompt_len_long():
    """A folder's subword tokenizer (a byte-level BPE, as most published ones are) decodes random
    ids to text that re-encodes into other pieces, ~10-30 % fewer of them: the synthetic requests
    of LLaVA's Processor around such a tokenizer are still prompt.prompt_len long, every seed."""
    import random

    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from pipeline.models.families import WORDS
    from pipeline.runtime.requests import Sources

    cfg = compose_cfg(["model=tiny_llava"])
    hf_config = zoo.build_hf_config(cfg.model)
    family = family_processor(hf_config)
    draw = random.Random(0)
    corpus = [
        " ".join(
            draw.choice(WORDS) + "".join(draw.choices("abcdefghij", k=draw.randint(0, 3))) for _ in range(30)
        )
        for _ in range(400)
    ]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(  # 500 pieces: the image token then takes the config's id, 500
        corpus,
        trainers.BpeTrainer(
            vocab_size=500,
            special_tokens=["<unk>", "<s>", "</s>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert tokenizer.convert_tokens_to_ids("<image>") == hf_config.image_token_index
    processor = transformers.LlavaProcessor(
        image_processor=family.image_processor,
        tokenizer=tokenizer,
        chat_template=family.chat_template,
        patch_size=family.patch_size,
        vision_feature_select_strategy=family.vision_feature_select_strategy,
        num_additional_image_tokens=1,
    )
    skeleton = meta.meta_model(zoo.resolve_model_class(cfg.model, hf_config), hf_config)
    sources = Sources(skeleton=skeleton, layout_processor=processor)
    lengths = [
        len(request.prompt)
        for seed in range(8)
        for request in build_requests(
            cfg.prompt, cfg.runtime, seed, hf_config, torch.float32, torch.device("cpu"), sources
        )
    ]
    assert lengths == [cfg.prompt.prompt_len] * len(lengths)


@pytest.mark.parametrize("name", ["mistral3", "qwen2_5_vl", "llama4_scout"])
def test_a_full_size_yamls_tokens_sit_at_its_configs_ids(name):
    """The tokenizer made for a seed-size config puts the image, begin/end and begin-of-text tokens
    at the config's ids (not those of the tiny configs), so its Processor writes image tokens the
    model reads as images."""
    cfg, hf_config, sources, request = _synthetic(name)
    text = zoo.text_config_of(hf_config)
    image_id = next(
        getattr(hf_config, n) for n in ("image_token_id", "image_token_index") if hasattr(hf_config, n)
    )
    tokenizer = sources.layout_processor.tokenizer
    assert tokenizer.convert_tokens_to_ids(tokenizer.bos_token) == text.bos_token_id
    ((start, end),) = request.image_spans
    assert request.prompt[start] == image_id == request.prompt[end - 1]
    assert len(request.prompt) == cfg.prompt.prompt_len and max(request.prompt) < text.vocab_size


def test_the_generic_layout_is_taken_by_name_and_said(tmp_path):
    """prompt.image_layout=generic: the image's tokens amid random ids, laid out by models/images.py
    (what a workload without the family's Processor gets); the load stage says which layout the
    synthetic requests take in one line, a text model's says nothing of it."""
    from pipeline.runtime.requests import Sources

    cfg, hf_config, sources, request = _synthetic("tiny_idefics3", ["prompt.image_layout=generic"])
    assert sources.layout_processor is None and "prompt.image_layout=generic" in sources.layout
    skeleton = sources.skeleton
    plain = build_requests(
        cfg.prompt,
        cfg.runtime,
        cfg.seed,
        hf_config,
        torch.float32,
        torch.device("cpu"),
        Sources(skeleton=skeleton),
    )[0]
    assert request.prompt == plain.prompt and request.prompt != _synthetic("tiny_idefics3")[3].prompt
    for layout in ("family", "generic"):
        with staged(
            ["model=tiny_llava", f"prompt.image_layout={layout}"], "load", tmp_path / layout
        ) as state:
            notes = state.stages[-1].notes
            assert sum(f"prompt.image_layout={layout}" in note for note in notes) == 1
    with staged(["model=tiny_qwen3"], "load", tmp_path / "text") as state:
        assert not any("prompt.image_layout" in note for note in state.stages[-1].notes)


def test_a_text_the_familys_processor_refuses_alone_is_its_chat_template_tokenized(
    processor_folders, pictures, tmp_path
):
    """PaliGemma's processor refuses a text without images, as Hugging Face's does: a text chat of
    its folder is the chat template's text in the folder's tokenizer's ids, not a refusal; an image
    chat is still the processor's."""
    from transformers import AutoProcessor

    folder = processor_folders["tiny_paligemma"]
    messages = _mixed_batch(pictures)[:2]
    processor = AutoProcessor.from_pretrained(folder, local_files_only=True)
    texts = [processor.apply_chat_template(chat, add_generation_prompt=True) for chat in messages]
    with pytest.raises(ValueError):
        processor(text=[texts[0]], return_tensors="pt")
    image = [Image.open(pictures[0]).convert("RGB")]
    want = [
        processor.tokenizer(texts[0], add_special_tokens=False)["input_ids"],
        processor(text=[texts[1]], images=image, return_tensors="pt")["input_ids"][0].tolist(),
    ]
    with staged(_folder_queries(folder, messages, "none"), "load", tmp_path) as state:
        cfg = state.cfg
        requests = build_requests(
            cfg.prompt, cfg.runtime, cfg.seed, state.hf_config, torch.float32, state.device, state.sources,
            chunked=False,
        )  # fmt: skip
    assert [r.prompt for r in requests] == want
    assert not requests[0].images and requests[1].images
