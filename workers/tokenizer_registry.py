"""The part of transformers 5's tokenizer registry that decides how ``AutoTokenizer`` reads a model
folder whose tokenizer_config.json (or config.json) names ``LlamaTokenizer`` (``Tokenizer.load``,
workers/tokenizer_folders.py ``uses_llama_tokenizer``). A snapshot of transformers 5.24.0's
``TOKENIZER_MAPPING_NAMES`` and ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``
(tests/test_tokenizer_hf_folders.py compares it with the transformers installed).

transformers loads such a folder as ``LlamaTokenizer`` (its own Metaspace pipeline over the
tokenizer.json) unless its tokenizer.json is byte-level, or config.json's ``model_type`` is
registered with a generic backend (then tokenizer.json is read as it is), or the model type is
one whose hub class transformers knows is wrong (then the registered class: Qwen2Tokenizer, ...).
Every other model type, registered with a class of its own or not registered at all (yi,
deepseek, baichuan, ...), gets LlamaTokenizer."""

SNAPSHOT_OF = "5.24"  # the transformers release (major.minor) these sets were read from

# model types registered with a generic backend (TokenizersBackend, PythonBackend,
# PreTrainedTokenizerFast, MistralCommonBackend): a folder naming LlamaTokenizer is read as saved
GENERIC_BACKEND_MODEL_TYPES = frozenset({
    'EvollaModel', 'arctic', 'aria', 'beam', 'bigbird_pegasus', 'camembertv2-base', 'canary',
    'chatlm', 'cohere_asr', 'ernie4_5', 'ernie4_5_moe', 'flex_olmo', 'fuyu', 'glm', 'glm4',
    'glm4_moe', 'glm4_moe_lite', 'glm4v', 'glm4v_moe', 'glm_image', 'glmasr', 'got_ocr2',
    'gpt_bigcode', 'gradium_phonon_tts', 'granite', 'granitemoe', 'granitemoehybrid',
    'granitemoeshared', 'h2ovl_chat', 'hyperclovax', 'hyperclovax_vlm', 'internlm2', 'internlm3',
    'iquestcoder', 'jamba', 'kimi_k25', 'kimi_linear', 'kosmos-2', 'llava', 'llava_next',
    'mimo_v2_flash', 'minicpm3', 'minicpm_ocr', 'minicpmv', 'minicpmv4_6', 'minicpmv4_7',
    'minimax_m2', 'ministral', 'ministral3', 'mistral', 'mistral3', 'mistral_large4', 'mixtral',
    'modernbert', 'modernbert-decoder', 'molmo', 'molmo2', 'nemo_speechlm', 'nemotron', 'nvfp4',
    'nystromformer', 'olmo2', 'olmo3', 'olmo_hybrid', 'omniasr', 'opencua', 'openvla',
    'paddleocr_vl', 'pegasus_x', 'persimmon', 'phi3', 'phi3_v', 'phimoe', 'pix2struct', 'pixtral',
    'pocket_tts', 'smolvlm', 'stablelm', 'step3_vl', 'umt5', 'vipllava', 'voxtral',
    'voxtral_realtime', 'xlm-roberta-xl',
})
# model types whose hub tokenizer class transformers overrides with its registered one
OVERRIDDEN_HUB_CLASS_MODEL_TYPES = frozenset({
    'hyperclovax_vision_v2', 'qwen2', 'qwen3_5', 'qwen3_5_moe', 'qwen3_5_moe_text', 'qwen4_exp',
    'siglip2',
})
