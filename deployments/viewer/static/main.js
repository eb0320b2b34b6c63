// The page's wiring: the model (several served: the picker), the knobs form (the decoding knobs of the
// model's paradigm), the query string, saved files, the runs' panels and the page state
// (document.body.dataset.state: idle -> running -> done | error).

import { KnobRow } from "./knobs.js";
import { Panel } from "./render.js";
import { ApiFailure, fieldsFromQuery, generateBody, getJson, setModel, streamGenerate, tokenIds } from "./request.js";
import { Run, runsFromSaved } from "./run.js";

const $ = (id) => document.getElementById(id);
// What the server put into the page: { knobs: paradigm -> its knobs, models: the served models (several:
// the picker offers them), model: the one shown (null: the application's only one), defaulted: no
// ?model= named it }
const CONFIG = { knobs: {}, models: [], model: null, defaulted: false, ...JSON.parse($("viewer-config").textContent) };
const KNOBS = ["temperature", "seed", "max_new_tokens"]; // every model's; the paradigm's are the knob row's
const knobRow = new KnobRow($("dllm-knobs"), CONFIG.knobs);
const panels = []; // index 0 is run A, 1 is run B

function updateState() {
  const statuses = panels.map((p) => p.root.dataset.status);
  const state = !$("error").hidden ? "error" : statuses.includes("running") ? "running" : "done";
  document.body.dataset.state = state;
}

/** Show a failure (appended: two runs may both fail); every action clears the old ones first. */
function showError(message) {
  const box = $("error");
  box.textContent = box.hidden ? message : `${box.textContent}\n${message}`;
  box.hidden = false;
  updateState();
}

function clearError() {
  $("error").hidden = true;
  $("error").textContent = "";
}

// the key is kept per application (its route prefix), for the browser tab's session only
const KEY_ITEM = `blockserve-viewer-key:${document.baseURI}`;

function apiKey() {
  const key = $("api-key").value.trim();
  sessionStorage.setItem(KEY_ITEM, key);
  return key;
}

function readForm() {
  const fields = {};
  const prompt = $("prompt").value;
  if ($("as-ids").checked) fields.input_ids = tokenIds(prompt, "prompt");
  else fields.prompt = prompt;
  Object.assign(fields, knobRow.values());
  for (const name of KNOBS) {
    const input = $(name);
    if (input.value === "") continue;
    fields[name] = Number(input.value);
  }
  return Object.assign(fields, readMore());
}

/** The "other /generate fields" box as an object. */
function readMore() {
  const more = $("more").value.trim();
  if (!more) return {};
  let extra;
  try {
    extra = JSON.parse(more);
  } catch (e) {
    throw new ApiFailure(`other /generate fields: not JSON (${e.message})`);
  }
  if (typeof extra !== "object" || extra === null || Array.isArray(extra)) {
    throw new ApiFailure('other /generate fields: give a JSON object, e.g. {"top_k": 20}');
  }
  return extra;
}

/** Each field into its input: the prompt, the knobs of the row and of every model; any other in the JSON box. */
function fillForm(fields) {
  const more = {};
  for (const [name, value] of Object.entries(fields)) {
    if (name === "prompt" || name === "input_ids") {
      $("as-ids").checked = name === "input_ids";
      $("prompt").value = name === "input_ids" ? value.join(", ") : value;
    } else if (KNOBS.includes(name)) {
      $(name).value = String(value);
    } else if (knobRow.has(name)) {
      knobRow.set(name, value);
    } else {
      more[name] = value;
    }
  }
  $("more").value = Object.keys(more).length ? JSON.stringify(more) : "";
}

/** The knob row of `paradigm`. A knob set in the old row (or, before the row was known, in the JSON box)
 *  keeps its value: in the new row where it has an input, else in the JSON box, so a run still sends it. */
function showKnobs(paradigm) {
  if (knobRow.paradigm === paradigm) return;
  let more;
  try {
    more = readMore();
  } catch {
    more = null; // a box that is not a JSON object stays as typed
  }
  const fields = { ...knobRow.values(), ...(more || {}) };
  knobRow.show(paradigm);
  const rest = {};
  for (const [name, value] of Object.entries(fields)) {
    if (knobRow.has(name)) knobRow.set(name, value);
    else rest[name] = value;
  }
  if (more !== null) $("more").value = Object.keys(rest).length ? JSON.stringify(rest) : "";
}

/** What the page needs of the server: its paradigm (the knob row shows the knobs it reads), block
 *  length, streaming mode, what logprob rows hold. A renoising model's canvases follow the prompt
 *  wherever it ends: they are grouped by each token's step within its canvas (block_step_map), not by
 *  multiples of the canvas length. */
async function serverInfo(key) {
  const info = await getJson("server_info", key);
  const state = (info.internal_states || [{}])[0];
  const engine = state.engine || {};
  const paradigm = state.dllm_paradigm || (state.is_dllm ? "block" : "autoregressive");
  const canvas = paradigm === "renoising";
  const anchored = paradigm === "seeded_block"; // blocks from the prompt end
  const shape = canvas ? `renoising canvases of ${engine.dllm_block_length}`
    : state.is_dllm ? `${paradigm === "block" ? "" : `${paradigm}, `}block length ${engine.dllm_block_length}` +
      (anchored ? " from the prompt end" : "")
    : "autoregressive";
  $("server").textContent = `${info.served_model_name} (${state.model_type || "?"}, ${shape})`;
  $("server").classList.remove("unknown");
  showKnobs(paradigm);
  return {
    canvas,
    anchored,
    blockLength: state.is_dllm && !canvas ? engine.dllm_block_length : null,
    incremental: Boolean(info.incremental_streaming_output),
    valueName: engine.logprobs_mode === "raw_logits" ? "logit" : "logprob",
  };
}

/** The header and the knob row for the server (on load, on another model or key); a server that does not
 *  answer yet (e.g. it needs the API key) is said in the header, not as a failed run. */
async function describeServer() {
  try {
    await serverInfo(apiKey());
  } catch (e) {
    $("server").textContent = `${CONFIG.model || "the server"}: ${e.message}`;
    $("server").classList.add("unknown");
  }
}

/** Several models: the picker, and (none named) which one the page shows; the URL names it. */
function showModels() {
  if (CONFIG.model === null) return;
  setModel(CONFIG.model);
  const several = CONFIG.models.length > 1;
  $("model-pick").hidden = !several;
  $("model").replaceChildren(...CONFIG.models.map((m) => new Option(m, m, m === CONFIG.model, m === CONFIG.model)));
  if (several && CONFIG.defaulted) {
    $("model-note").textContent = `Showing ${CONFIG.model}, the first of the ${CONFIG.models.length} models this ` +
      `server serves (${CONFIG.models.join(", ")}): pick another with Model.`;
    $("model-note").hidden = false;
  }
  nameModelInUrl(CONFIG.model);
}

function nameModelInUrl(model) {
  const url = new URL(location.href);
  url.searchParams.set("model", model);
  history.replaceState(null, "", url);
}

function pickModel(model) {
  CONFIG.model = model;
  setModel(model);
  nameModelInUrl(model);
  $("model-note").hidden = true;
  describeServer();
}

function place(index, run) {
  for (const old of panels.splice(index)) old.root.remove(); // a new A drops B as well
  const panel = new Panel($("runs"), run);
  panel.colourBy = $("colour-by").value;
  panels[index] = panel;
  return panel;
}

/** Start one request per field set, drawn in panels from `first` on (A = 0, B = 1). */
async function start(fieldSets, first) {
  clearError();
  document.body.dataset.state = "running";
  let key;
  let info;
  try {
    key = apiKey();
    info = await serverInfo(key);
  } catch (e) {
    showError(e.message);
    return;
  }
  await Promise.all(fieldSets.map(async (fields, k) => {
    const run = new Run(String.fromCharCode(65 + first + k), info); // info.canvas: grouped by canvas
    run.settings = fields;
    const panel = place(first + k, run);
    panel.setStatus("decoding…", "running");
    updateState();
    try {
      const body = generateBody(info.canvas ? { return_block_step_map: true, ...fields } : fields);
      await streamGenerate(key, body, (chunk) => {
        run.applyChunk(chunk);
        panel.draw();
      });
      if (run.finish && run.finish.type === "error") {
        throw new ApiFailure(`the request failed on the server: ${run.finish.message}`);
      }
      panel.setStatus(`done (${run.finish ? run.finish.type : "?"})`, "done");
    } catch (e) {
      panel.setStatus("failed", "error");
      showError(`run ${run.label}: ${e.message}`);
    }
    panel.draw();
    updateState();
  }));
}

function showSaved(runs) {
  runs.forEach((run, k) => {
    const panel = place(k, run);
    panel.setStatus(`opened (${run.finish.type})`, "done");
    panel.draw();
  });
  updateState();
}

async function openFiles(files) {
  clearError();
  try {
    const texts = await Promise.all([...files].map((f) => f.text()));
    showSaved(texts.flatMap((text, k) => runsFromSaved(JSON.parse(text), String.fromCharCode(65 + k))));
  } catch (e) {
    showError(`opening ${[...files].map((f) => f.name).join(", ")}: ${e.message}`);
  }
}

async function openUrl(url) {
  clearError();
  try {
    const response = await fetch(url);
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    showSaved(runsFromSaved(await response.json(), "A"));
  } catch (e) {
    showError(`opening ${url}: ${e.message}`);
  }
}

function runFromForm(index) {
  let fields;
  try {
    fields = readForm();
  } catch (e) {
    clearError();
    showError(e.message);
    return;
  }
  start([fields], index);
}

function wire() {
  $("api-key").value = sessionStorage.getItem(KEY_ITEM) || "";
  $("api-key").addEventListener("change", () => describeServer());
  $("model").addEventListener("change", () => pickModel($("model").value));
  $("knobs").addEventListener("submit", (e) => {
    e.preventDefault();
    runFromForm(0);
  });
  $("run-b").addEventListener("click", () => runFromForm(panels.length ? 1 : 0));
  $("open-file").addEventListener("change", (e) => openFiles(e.target.files));
  $("colour-by").addEventListener("change", () => panels.forEach((p) => {
    p.colourBy = $("colour-by").value;
    p.draw();
  }));
  document.addEventListener("dragover", (e) => e.preventDefault());
  document.addEventListener("drop", (e) => {
    e.preventDefault();
    openFiles(e.dataTransfer.files);
  });
  document.addEventListener("keydown", (e) => {
    if (["INPUT", "TEXTAREA", "SELECT"].includes(e.target.tagName)) return; // a focused slider moves itself
    const delta = { ArrowLeft: -1, ArrowRight: 1, Home: -Infinity, End: Infinity }[e.key];
    if (delta === undefined) return;
    e.preventDefault();
    panels.forEach((p) => p.stepBy(delta));
  });
}

async function load() {
  wire();
  showModels();
  let query;
  try {
    query = fieldsFromQuery(location.search);
  } catch (e) {
    showError(e.message);
    return;
  }
  await describeServer(); // the knob row first, so that the query's knobs fill it
  fillForm(query.a);
  if (query.trace) openUrl(query.trace);
  else if ("prompt" in query.a || "input_ids" in query.a) {
    // A run from the query string sends what the form now shows (its defaults, e.g. temperature 0, where
    // the URL names nothing), as the Run button would; B is that with its own fields over it.
    const a = readForm();
    start(query.b ? [a, { ...a, ...query.b }] : [a], 0);
  }
}

load();
