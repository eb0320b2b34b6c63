"""The bounds of one request, shared by `GenerationConfig` and the HTTP request models, so that a
limit is stated once and a bad value is refused with the same rule wherever it enters."""

MAX_STOP_STRINGS = 64  # stop strings per request (a longer list is a 400 naming `stop`)
MAX_STOP_STRING_CHARS = 1024  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_TOP_LOGPROBS = 100
MAX_ALLOWED_IDS = 256  # ids in one slot's allowed set (dllm_allowed_token_ids)
MAX_TEMPLATE = 65536  # positions of a dllm_template
MAX_N = 64  # samples per prompt (n)
MAX_BATCH = 1024  # prompts per request (a batch list), and generations (prompts x n)
MAX_SEED = 2**63 - 1
MAX_TOP_K = 2**31 - 1
# Temperatures in (0, SAMPLING_EPS) sample as greedy: dividing logits by them overflows float32
# (vLLM does the same). Repetition penalties outside [MIN, MAX] would overflow the logits too.
SAMPLING_EPS = 1e-5
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
