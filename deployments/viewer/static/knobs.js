// The knob row: the decoding knobs the served model's paradigm reads, built from the knob table the
// server puts into the page (configs.knobs, per paradigm: name, label, doc, the rules that read it,
// and how its input takes a value). A blank input is the server's setting.

function element(tag, attrs = {}, text = null) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== null) node.textContent = text;
  return node;
}

/** An input's value as the knob takes it: a number, a rule's name, or (other knobs) JSON where it parses. */
function valueOf(knob, input) {
  if (knob.kind === "int" || knob.kind === "float") return Number(input.value);
  if (knob.kind === "choice") return input.value;
  try {
    return JSON.parse(input.value);
  } catch {
    return input.value;
  }
}

export class KnobRow {
  /** @param {HTMLElement} root  the row; @param {object} table  paradigm -> its knobs */
  constructor(root, table) {
    this.root = root;
    this.table = table;
    this.paradigm = null;
    this.knobs = new Map(); // name -> { knob, input }
  }

  has(name) {
    return this.knobs.has(name);
  }

  /** The row of `paradigm`'s knobs (empty for a paradigm with none, e.g. autoregressive). */
  show(paradigm) {
    this.paradigm = paradigm;
    this.root.dataset.paradigm = paradigm;
    this.knobs.clear();
    const nodes = [];
    const knobs = this.table[paradigm];
    if (!knobs) {
      nodes.push(element("span", { class: "knobs-note" }, `no decoding knobs known for "${paradigm}"`));
    } else if (!knobs.length) {
      nodes.push(element("span", { class: "knobs-note" }, `${paradigm}: no decoding knobs`));
    }
    for (const knob of knobs || []) {
      const title = knob.rules ? `${knob.doc}\n(read by ${knob.rules.join(", ")})` : knob.doc;
      const label = element("label", { title }, `${knob.label} `);
      const attrs = { id: knob.name, placeholder: "server's" };
      if (knob.kind === "int" || knob.kind === "float") {
        Object.assign(attrs, { type: "number", step: knob.kind === "int" ? "1" : "any" });
        if (knob.min !== undefined) attrs.min = String(knob.min);
        if (knob.max !== undefined) attrs.max = String(knob.max);
      } else if (knob.kind === "choice") {
        // a free text box with the choices offered: a name the server refuses comes back naming the field
        attrs.list = `choices-${knob.name}`;
      }
      const input = element("input", attrs);
      label.append(input);
      if (knob.kind === "choice") {
        const list = element("datalist", { id: `choices-${knob.name}` });
        for (const choice of knob.choices) list.append(element("option", { value: choice }));
        label.append(list);
      }
      this.knobs.set(knob.name, { knob, input });
      nodes.push(label);
    }
    this.root.replaceChildren(...nodes);
  }

  set(name, value) {
    this.knobs.get(name).input.value = String(value);
  }

  /** The knobs set (blank: the server's setting, not sent). */
  values() {
    const fields = {};
    for (const [name, { knob, input }] of this.knobs) {
      if (input.value !== "") fields[name] = valueOf(knob, input);
    }
    return fields;
  }
}
