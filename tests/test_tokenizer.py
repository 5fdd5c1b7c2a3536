"""glm53.tokenizer against transformers' PreTrainedTokenizerFast / apply_chat_template on a small GLM-like folder."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from tokenizers import decoders as tk_decoders
from transformers import PreTrainedTokenizerFast

from glm53.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, glm_chat_text, load_tokenizer

SPECIALS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
            "<think>", "</think>", "<tool_response>", "</tool_response>"]  # fmt: skip

# A GLM-like template (written for this test): tools block with tojson, a namespace, reasoning only after the last
# user turn, tool responses as observations, raise_exception on unknown roles, the enable_thinking switch.
TEMPLATE = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}<|system|>{{ m.content }}
{%- elif m.role == 'user' -%}<|user|>{{ m.content }}
{%- elif m.role == 'assistant' -%}<|assistant|>
  {%- if loop.index0 > ns.last_user and m.reasoning_content -%}<think>{{ m.reasoning_content }}</think>
  {%- else -%}</think>{%- endif -%}
{{ m.content }}
{%- elif m.role == 'tool' -%}<|observation|><tool_response>{{ m.content }}</tool_response>
{%- else -%}{{ raise_exception('unknown role ' ~ m.role) }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|assistant|>{{ '</think>' if (enable_thinking is defined and not enable_thinking) else '<think>' }}
{%- endif -%}"""

TRAIN = ["Hello world, this is a tiny tokenizer.", "你好，世界！", "The weather in Paris is sunny today.",
         "Call the tool get_weather with city Paris.", "1 + 2 = 3; 12 * 12 = 144"]  # fmt: skip

CHATS = [
    [{"role": "user", "content": "Hello world"}],
    [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "你好，世界！"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
        {"role": "user", "content": "The weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "use the tool"},
        {"role": "tool", "content": '{"temp": 21}'},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "天气", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]  # fmt: skip


def _write_folder(path, template_in_config=True):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk_decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(TRAIN, trainer)
    tok.save(str(path / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    }
    if template_in_config:
        cfg["chat_template"] = TEMPLATE
    else:
        (path / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return path


@pytest.fixture(scope="module", params=["config", "jinja_file"])
def folder(request, tmp_path_factory):
    return _write_folder(tmp_path_factory.mktemp(request.param), template_in_config=request.param == "config")


@pytest.fixture(scope="module")
def ref(folder):
    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def test_encode_decode_match_transformers(folder, ref):
    tok = load_tokenizer(folder)
    assert isinstance(tok, HFTokenizer)
    assert tok.vocab_size == len(ref)
    for text in TRAIN + ["unseen words: zebra 🦓", "[gMASK]<sop><|user|>hi"]:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.decode(ids) == ref.decode(ids)
    # Special tokens are single ids.
    assert tok.encode("[gMASK]<sop>") == [tok.token_to_id("[gMASK]"), tok.token_to_id("<sop>")]


@pytest.mark.parametrize("chat", range(len(CHATS)))
@pytest.mark.parametrize("kw", [{}, {"enable_thinking": False}, {"tools": TOOLS}])
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(folder, ref, chat, kw, gen):
    tok = load_tokenizer(folder)
    msgs = CHATS[chat]
    want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kw)
    got = tok.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=False, **kw)
    assert got == want
    assert got.startswith("[gMASK]<sop>")
    ids = tok.apply_chat_template(msgs, add_generation_prompt=gen, **kw)
    assert ids == ref.encode(want, add_special_tokens=False)
    assert ids[:2] == [tok.token_to_id("[gMASK]"), tok.token_to_id("<sop>")]


def test_template_errors_are_clear(folder):
    tok = load_tokenizer(folder)
    with pytest.raises(TokenizerError, match="unknown role wizard"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])


def test_plain_glm_format_without_template(tmp_path):
    _write_folder(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    tok = load_tokenizer(tmp_path)
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "[gMASK]<sop><|system|>S<|user|>Hi<|assistant|>"
    assert glm_chat_text(msgs, add_generation_prompt=False) == "[gMASK]<sop><|system|>S<|user|>Hi"
    assert tok.apply_chat_template(msgs)[:3] == [
        tok.token_to_id(t) for t in ("[gMASK]", "<sop>", "<|system|>")
    ]
    with pytest.raises(TokenizerError, match="unknown role"):
        glm_chat_text([{"role": "narrator", "content": "x"}])


def test_byte_fallback(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 128}}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 128
    assert tok.encode("Hi!") == [72, 105, 33]
    assert tok.decode(tok.encode("plain ASCII text")) == "plain ASCII text"
    assert tok.encode("é") == [0xC3 % 128, 0xA9 % 128]  # lossy below 256: documented
    big = ByteTokenizer(300)
    assert big.decode(big.encode("你好 é")) == "你好 é"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == list(
        b"[gMASK]<sop><|user|>x<|assistant|>"
    )
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "nowhere")
