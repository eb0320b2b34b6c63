// The page's requests: the /generate body from the knobs, the knobs from the query string, and the
// Server-Sent Events stream read chunk by chunk. URLs are relative to the page's <base> (the
// application's route prefix); on an application of several models each names the page's model
// (`?model=`), which its front ingress routes by.

// Fields of SGLang's native body that sit at its top level; every other field goes in sampling_params.
const TOP_LEVEL = new Set(["return_logprob", "top_logprobs_num", "logprob_start_len", "return_text_in_logprobs",
                           "return_block_step_map", "return_dllm_replay", "rid"]);
// Other names a query string may use for the knobs (the flat /generate body's and SGLang's).
const ALIASES = { text: "prompt", max_tokens: "max_new_tokens", sampling_seed: "seed" };

export class ApiFailure extends Error {}

let model = null; // the model the page shows, on an application of several models

export function setModel(name) {
  model = name;
}

/** A route of the application, naming the page's model when there is one. */
export function apiUrl(path) {
  return model === null ? path : `${path}?${new URLSearchParams({ model })}`;
}

/** The native /generate body of the knobs: streamed, with the step trace and each token's text. */
export function generateBody(fields) {
  if (fields.n != null && fields.n !== 1) {
    throw new ApiFailure("n: the viewer draws one sample per run; leave n at 1 (Run as B draws a second run)");
  }
  const body = { sampling_params: {} };
  for (const [name, value] of Object.entries(fields)) {
    if (value === null || value === undefined || value === "") continue;
    if (name === "prompt") body.text = value;
    else if (name === "input_ids") body.input_ids = value;
    else if (name === "seed") body.sampling_params.sampling_seed = value;
    else if (TOP_LEVEL.has(name)) body[name] = value;
    else body.sampling_params[name] = value;
  }
  return { ...body, stream: true, return_step_trace: true, return_logprob: true, return_text_in_logprobs: true };
}

/** "1, 2,3" -> [1, 2, 3]; anything else is refused naming the field. */
export function tokenIds(text, name) {
  const parts = text.split(",").map((s) => s.trim()).filter((s) => s !== "");
  if (!parts.length || !parts.every((s) => /^\d+$/.test(s))) {
    throw new ApiFailure(`${name}: token ids must be comma-separated non-negative integers, got "${text}"`);
  }
  return parts.map(Number);
}

function queryValue(name, raw) {
  if (name === "prompt") return raw;
  if (name === "input_ids") return tokenIds(raw, "input_ids");
  try {
    return JSON.parse(raw); // numbers, true / false, lists
  } catch {
    return raw; // a plain string, e.g. a strategy's name
  }
}

/** The query string as { a: fields of run A, b: fields of run B (A's with every `b.NAME` over them)
 *  or null, trace: a saved trace's URL or null }; `model` is the page's model (the server read it). */
export function fieldsFromQuery(search) {
  const a = {};
  const b = {};
  let trace = null;
  for (const [key, raw] of new URLSearchParams(search)) {
    if (key === "trace") {
      trace = raw;
      continue;
    }
    if (key === "model") continue;
    const inB = key.startsWith("b.");
    const name = ALIASES[inB ? key.slice(2) : key] || (inB ? key.slice(2) : key);
    (inB ? b : a)[name] = queryValue(name, raw);
  }
  return { a, b: Object.keys(b).length ? { ...a, ...b } : null, trace };
}

function headers(key) {
  const h = { "Content-Type": "application/json" };
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function failure(response, what) {
  const text = await response.text();
  let error = null;
  try {
    error = JSON.parse(text).error;
  } catch {
    // not the API's error JSON (a proxy's page): the status says it
  }
  if (!error) return new ApiFailure(`${what}: HTTP ${response.status} ${text.slice(0, 200)}`);
  const field = error.param ? ` [field: ${error.param}]` : "";
  const hint = response.status === 401 ? " — enter the server's API key above" : "";
  return new ApiFailure(`${what}: HTTP ${response.status} ${error.type}${field}: ${error.message}${hint}`);
}

export async function getJson(url, key) {
  const response = await fetch(apiUrl(url), { headers: headers(key) });
  if (!response.ok) throw await failure(response, `GET ${url}`);
  return response.json();
}

/** POST the body and call onChunk with each SSE chunk until `data: [DONE]`. */
export async function streamGenerate(key, body, onChunk) {
  const response = await fetch(apiUrl("generate"),
                               { method: "POST", headers: headers(key), body: JSON.stringify(body) });
  if (!response.ok) throw await failure(response, "POST /generate");
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new ApiFailure("POST /generate: the stream ended before data: [DONE]");
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice("data: ".length);
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) {
          throw new ApiFailure(`POST /generate: ${chunk.error.type}: ${chunk.error.message}`);
        }
        onChunk(chunk);
      }
    }
  }
}
