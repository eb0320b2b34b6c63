// One run's data, without any drawing: each generated position with every write to it (a step of
// the step trace, or the released output), from live /generate chunks or from a saved body.

/** How many times a position's content was rewritten (moves by insert/delete editing aside). */
export function edited(writes) {
  return Math.max(0, writes.filter((w) => !w.moved).length - 1);
}

export class Run {
  /**
   * @param {string} label  the panel's name (A, B, ...)
   * @param {object} opts   blockLength: the model's block length B (null when unknown);
   *                        anchored: the blocks start at the prompt end (a seeded-block model's), so
   *                        block k holds generated positions [kB, (k+1)B);
   *                        canvas: a renoising model's run, whose groups are canvases that follow the
   *                        prompt (told apart by block_step_map, numbered 1, 2, ... in order);
   *                        incremental: the stream sends deltas rather than cumulative chunks;
   *                        valueName: what the logprob rows hold ("logprob" or "logit")
   */
  constructor(label, { blockLength = null, anchored = false, canvas = false, incremental = false,
                       valueName = "logprob" } = {}) {
    this.label = label;
    this.canvas = canvas;
    this.anchored = anchored;
    this.speculative = false; // a LinearSpec run (its chunks carry acceptance_lengths): grouped by verify
    this.blockLength = canvas ? null : blockLength;
    this.incremental = incremental;
    this.valueName = valueName;
    this.cells = []; // per position: { writes: [{ step, tokenId }], final: { tokenId, step, value } | null }
    this.outputIds = [];
    this.blockIds = []; // per released position, from block_step_map: its block's (canvas's) first step - 1
    this.texts = new Map(); // token id -> its text
    this.promptTokens = null;
    this.serverSteps = null; // meta_info.dllm_num_steps
    this.finish = null; // meta_info.finish_reason once the request ended
    this.settings = {}; // the fields that made it (the panel's title)
  }

  get finished() {
    return this.finish !== null;
  }

  cell(position) {
    while (this.cells.length <= position) this.cells.push({ writes: [], final: null });
    return this.cells[position];
  }

  /** A write of `tokenId` at `position` by `step`; a position written again is an edit. */
  write(position, tokenId, step) {
    const writes = this.cell(position).writes;
    const last = writes[writes.length - 1];
    if (!last || last.step !== step || last.tokenId !== tokenId) writes.push({ step, tokenId });
  }

  /** One step trace event: its writes, then (insert/delete editing) the positions whose content left
   *  the block emptied and every moved token's history carried to its new position, marked moved. */
  applyEvent(event) {
    event.positions.forEach((p, i) => this.write(p, event.token_ids[i], event.step));
    if (!event.moves) return;
    const moved = event.moves.map(([from]) => this.cell(from).writes);
    for (const p of event.deleted || []) this.cell(p).writes = [];
    for (const [from] of event.moves) this.cell(from).writes = [];
    event.moves.forEach(([, to], i) => {
      const writes = moved[i];
      const last = writes[writes.length - 1];
      this.cell(to).writes = last ? [...writes, { step: event.step, tokenId: last.tokenId, moved: true }] : [];
    });
  }

  /** One /generate chunk (cumulative or a delta), or a whole unary body. */
  applyChunk(chunk) {
    const meta = chunk.meta_info || {};
    if (meta.prompt_tokens != null) this.promptTokens = meta.prompt_tokens;
    if (meta.dllm_num_steps != null) this.serverSteps = meta.dllm_num_steps;
    if (meta.acceptance_lengths != null) this.speculative = true;
    for (const event of meta.step_trace || []) this.applyEvent(event);
    const start = this.incremental ? this.outputIds.length : 0;
    const rows = meta.output_token_logprobs || [];
    (chunk.output_ids || []).forEach((tokenId, i) => {
      const position = start + i;
      // an autoregressive model has no step_map: one step per token
      const step = meta.step_map ? meta.step_map[i] : position + 1;
      const row = rows[i];
      if (row && row[2] != null) this.texts.set(tokenId, row[2]);
      if (meta.block_step_map) this.blockIds[position] = step - meta.block_step_map[i];
      this.outputIds[position] = tokenId;
      const cell = this.cell(position);
      const last = cell.writes[cell.writes.length - 1];
      if (!last || last.tokenId !== tokenId) cell.writes.push({ step, tokenId });
      cell.final = { tokenId, step, value: row ? row[0] : null };
    });
    if (meta.finish_reason) {
      this.finish = meta.finish_reason;
      this.cells.length = this.outputIds.length; // positions decoded past the stop are not output
    }
  }

  get maxStep() {
    let max = 0;
    for (const cell of this.cells) for (const w of cell.writes) max = Math.max(max, w.step);
    return max;
  }

  text(tokenId) {
    return this.texts.has(tokenId) ? this.texts.get(tokenId) : `#${tokenId}`;
  }

  /** What a group of positions is: a canvas, a LinearSpec verify, or a block. */
  get unit() {
    return this.canvas ? "canvas" : this.speculative ? "verify" : "block";
  }

  /** The block of each position: a LinearSpec run's by the verify (its step) that accepted it; by B from
   *  the prompt end for a seeded-block model; by B and the prompt length when known; else by
   *  block_step_map. */
  blockOf(position) {
    if (this.speculative) {
      const { writes, final } = this.cells[position];
      return final ? final.step : writes.length ? writes[writes.length - 1].step : 0;
    }
    if (this.blockLength && this.anchored) return Math.floor(position / this.blockLength);
    if (this.blockLength && this.promptTokens != null) {
      return Math.floor((this.promptTokens + position) / this.blockLength);
    }
    for (let p = Math.min(position, this.blockIds.length - 1); p >= 0; p--) {
      if (this.blockIds[p] !== undefined) return this.blockIds[p];
    }
    return 0;
  }

  /** Positions grouped by block, in order: [{ block, positions, name }]. `name` is what the page calls the
   *  group: a block by its index (`block` k covers absolute positions [kB, (k+1)B), or generated ones
   *  when anchored), a canvas or a verify by its place among them (canvases from 1; verifies from 0, the
   *  prefill's token: its `block`, a step, only tells it apart). */
  blocks() {
    const groups = [];
    this.cells.forEach((_, position) => {
      const block = this.blockOf(position);
      const last = groups[groups.length - 1];
      if (last && last.block === block) last.positions.push(position);
      else {
        const name = this.canvas ? groups.length + 1 : this.speculative ? groups.length : block;
        groups.push({ block, positions: [position], name });
      }
    });
    return groups;
  }

  /** A group's label on the page: "block 3", "canvas 2", "verify 4" ("prefill": a LinearSpec run's first token). */
  groupLabel(group) {
    return this.speculative && group.name === 0 ? "prefill" : `${this.unit} ${group.name}`;
  }

  /** A group of blocks() as a position's tooltip names it: "block 3", "canvas 2: positions 16–31", or
   *  "verify 4: 5 tokens accepted". */
  describe(group) {
    const first = group.positions[0], last = group.positions[group.positions.length - 1];
    if (this.speculative) {
      return group.name === 0 ? "prefill: its last row's token, the first seed"
        : `verify ${group.name}: ${group.positions.length} tokens accepted (positions ${first}–${last})`;
    }
    if (!this.canvas) return `block ${group.name}`;
    return `canvas ${group.name}: positions ${first}–${last}`;
  }

  /** Writes per step (edits count): Map step -> tokens written. */
  tokensPerStep() {
    const counts = new Map();
    for (const cell of this.cells) for (const w of cell.writes) counts.set(w.step, (counts.get(w.step) || 0) + 1);
    return new Map([...counts.entries()].sort((a, b) => a[0] - b[0]));
  }

  /** Per block (canvas): its name, steps, tokens and edits. */
  blockFigures() {
    return this.blocks().map(({ name, positions }) => {
      const steps = new Set();
      let edits = 0;
      for (const p of positions) {
        const writes = this.cells[p].writes;
        writes.forEach((w) => steps.add(w.step));
        edits += edited(writes);
      }
      return { name, tokens: positions.length, steps: steps.size, edits };
    });
  }
}

/** A saved file as runs: a /generate body (or a list of them, e.g. a batch), optionally with the
 *  `trace` extras `python -m engine.trace --json` writes (block_length, settings, token_texts; a
 *  `paradigm` of "renoising" groups the positions in canvases, by meta_info.block_step_map, one of
 *  "seeded_block" counts its blocks from the prompt end). */
export function runsFromSaved(json, firstLabel) {
  const bodies = Array.isArray(json) ? json : [json];
  return bodies.map((body, k) => {
    if (!body || typeof body !== "object" || !Array.isArray(body.output_ids) || !body.meta_info) {
      throw new Error("this file is neither a trace (python -m engine.trace --json) nor a /generate body: " +
                      "it needs output_ids and meta_info (with step_trace for the steps)");
    }
    const extras = body.trace || {};
    const run = new Run(String.fromCharCode(firstLabel.charCodeAt(0) + k),
                        { blockLength: extras.block_length, canvas: extras.paradigm === "renoising",
                          anchored: extras.paradigm === "seeded_block" });
    run.settings = { ...(extras.prompt != null ? { prompt: extras.prompt } : {}), ...(extras.settings || {}) };
    for (const [id, text] of Object.entries(extras.token_texts || {})) run.texts.set(Number(id), text);
    run.applyChunk(body);
    if (!run.finished) run.applyChunk({ meta_info: { finish_reason: { type: "saved" } } });
    return run;
  });
}
