// rlhflab preference labelling page.
//
// Model text is untrusted: every string from the server goes into the page through
// textContent / createTextNode, never innerHTML. The small markdown renderer below builds
// DOM nodes the same way, so a response containing <script> shows as text.
"use strict";

(function () {
  const config = JSON.parse(document.body.dataset.config);
  const $ = (id) => document.getElementById(id);
  const NAME_KEY = "rlhflab.label.annotator";
  const RAW_KEY = "rlhflab.label.raw";

  let annotator = config.annotator_fixed ? config.annotator : localStorage.getItem(NAME_KEY);
  let current = null;       // the pair on screen: {pair_id, prompt, left, right, flipped}
  let submissionId = null;  // one id per pair shown: a retry or a double click reuses it
  let shownAt = 0;
  let busy = false;

  // ------------------------------------------------------------ markdown (safe subset)

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  const INLINE = /(`+)([\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|\*(?=[^\s*])([^*]*?[^\s*])\*/;

  function inline(parent, text) {
    while (text.length) {
      const m = INLINE.exec(text);
      if (!m) { parent.appendChild(document.createTextNode(text)); return; }
      if (m.index) parent.appendChild(document.createTextNode(text.slice(0, m.index)));
      if (m[1]) parent.appendChild(el("code", null, m[2]));
      else if (m[3] !== undefined) inline(parent.appendChild(el("strong")), m[3]);
      else inline(parent.appendChild(el("em")), m[4]);
      text = text.slice(m.index + m[0].length);
    }
  }

  function inlineLines(parent, lines) {
    lines.forEach((line, k) => {
      if (k) parent.appendChild(el("br"));
      inline(parent, line);
    });
  }

  const FENCE = /^\s*(```|~~~)/;
  const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const QUOTE = /^\s{0,3}>\s?(.*)$/;
  const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;

  function isBlockStart(line) {
    return FENCE.test(line) || HEADING.test(line) || ITEM.test(line) || QUOTE.test(line) || RULE.test(line);
  }

  function markdown(parent, text) {
    const lines = text.replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let m;
      if (/^\s*$/.test(line)) { i++; continue; }
      if ((m = FENCE.exec(line))) {
        const body = [];
        i++;
        while (i < lines.length && !lines[i].trimStart().startsWith(m[1])) body.push(lines[i++]);
        i++;  // the closing fence (or the end)
        const pre = parent.appendChild(el("pre"));
        pre.appendChild(el("code", null, body.join("\n")));
        continue;
      }
      if (RULE.test(line)) { parent.appendChild(el("hr")); i++; continue; }
      if ((m = HEADING.exec(line))) {
        inline(parent.appendChild(el("div", "md-h md-h" + m[1].length)), m[2]);
        i++;
        continue;
      }
      if (QUOTE.test(line)) {
        const body = [];
        while (i < lines.length && (m = QUOTE.exec(lines[i]))) { body.push(m[1]); i++; }
        markdown(parent.appendChild(el("blockquote")), body.join("\n"));
        continue;
      }
      if ((m = ITEM.exec(line))) {
        const ordered = /\d/.test(m[2]);
        const list = parent.appendChild(el(ordered ? "ol" : "ul"));
        if (ordered && parseInt(m[2], 10) !== 1) list.start = parseInt(m[2], 10);
        let item = null;
        while (i < lines.length) {
          const im = ITEM.exec(lines[i]);
          if (im && (/\d/.test(im[2]) === ordered)) {
            item = list.appendChild(el("li"));
            inline(item, im[3]);
          } else if (item && /^\s+\S/.test(lines[i]) && !isBlockStart(lines[i])) {
            item.appendChild(el("br"));
            inline(item, lines[i].trim());
          } else break;
          i++;
        }
        continue;
      }
      const para = [];
      while (i < lines.length && !/^\s*$/.test(lines[i]) && (para.length === 0 || !isBlockStart(lines[i]))) {
        para.push(lines[i++]);
      }
      inlineLines(parent.appendChild(el("p")), para);
    }
  }

  function show(node, text) {
    node.replaceChildren();
    const raw = $("raw").checked;
    node.classList.toggle("raw", raw);
    if (raw) node.textContent = text;
    else markdown(node, text);
    node.scrollTop = 0;
  }

  // ------------------------------------------------------------ server calls

  async function api(method, path, body) {
    const opts = { method, headers: { "Accept": "application/json" }, credentials: "same-origin" };
    if (body !== undefined) {
      opts.headers["Content-Type"] = "application/json";
      opts.body = JSON.stringify(body);
    }
    const resp = await fetch(path, opts);
    let data = null;
    try { data = await resp.json(); } catch (e) { /* not JSON */ }
    if (!resp.ok) {
      const err = new Error((data && data.error) || ("HTTP " + resp.status));
      err.status = resp.status;
      throw err;
    }
    return { status: resp.status, data };
  }

  // Retries network errors and 5xx with the same submission_id: the server stores it once.
  async function postWithRetry(path, body) {
    let delay = 300;
    for (let attempt = 1; ; attempt++) {
      try {
        return await api("POST", path, body);
      } catch (err) {
        const retriable = err.status === undefined || err.status >= 500;
        if (!retriable || attempt >= 6) throw err;
        setStatus("Connection problem, retrying (" + attempt + ")…", "warn");
        await new Promise((r) => setTimeout(r, delay));
        delay = Math.min(delay * 2, 4000);
      }
    }
  }

  function newId() {
    const bytes = new Uint8Array(16);
    crypto.getRandomValues(bytes);
    return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
  }

  // ------------------------------------------------------------ page state

  function setStatus(text, kind) {
    const node = $("status");
    node.textContent = text;
    node.className = "status" + (kind ? " " + kind : "");
  }

  function setProgress(p) {
    if (!p) return;
    let text = "Labelled " + p.labelled_pairs + " / " + p.total_pairs + " pairs";
    if (p.labels_per_pair && p.labels_per_pair > 1) {
      text = "Labels " + p.labels + " / " + p.total_pairs * p.labels_per_pair +
        " (" + p.complete_pairs + " / " + p.total_pairs + " pairs complete)";
    }
    if (p.mine !== undefined) text += " · you: " + p.mine;
    $("progress").textContent = text;
  }

  function screen(name) {
    for (const id of ["signin", "task", "done"]) $(id).hidden = id !== name;
    $("who").hidden = !annotator;
    $("who-name").textContent = annotator || "";
    $("change-name").hidden = !!config.annotator_fixed;
  }

  function resetInputs() {
    $("comment").value = "";
    updateCounter();
    for (const box of document.querySelectorAll("#criteria input")) box.checked = false;
  }

  async function loadNext() {
    busy = true;
    setLevelsEnabled(false);
    try {
      const { data } = await api("GET", "/api/next?annotator=" + encodeURIComponent(annotator));
      setProgress(data.progress);
      current = data.pair;
      if (!current) {
        const held = data.progress && data.progress.reserved_pairs;
        $("done-detail").textContent = held
          ? held + " pair(s) are on other annotators' screens now; if they skip them, they come " +
            "back to you: press Check again in a while."
          : "Thank you! Every pair is labelled, or you have labelled or skipped all the others.";
        screen("done");
        return;
      }
      submissionId = newId();
      shownAt = Date.now();
      show($("prompt"), current.prompt);
      show($("left"), current.left);
      show($("right"), current.right);
      resetInputs();
      screen("task");
    } catch (err) {
      screen("task");
      setStatus("Could not load a pair: " + err.message, "error");
    } finally {
      busy = false;
      setLevelsEnabled(true);
    }
  }

  function setLevelsEnabled(on) {
    for (const b of document.querySelectorAll("#levels button, #skip")) b.disabled = !on;
  }

  async function submit(level) {
    if (busy || !current) return;
    busy = true;
    setLevelsEnabled(false);
    const picked = Array.from(document.querySelectorAll("#criteria input:checked"), (b) => b.value);
    const body = {
      submission_id: submissionId, annotator, pair_id: current.pair_id, level,
      flipped: current.flipped, comment: $("comment").value, criteria: picked,
      elapsed_ms: Math.min(Date.now() - shownAt, 7 * 24 * 3600 * 1000),
    };
    try {
      await postWithRetry("/api/labels", body);
      setStatus("Saved: " + config.levels[String(level)] + ".", "ok");
      busy = false;
      await loadNext();
    } catch (err) {
      setStatus("Not saved: " + err.message, "error");
      busy = false;
      setLevelsEnabled(true);
      // the pair is gone or already labelled (another tab?): move on, keeping the message
      if (err.status === 404 || err.status === 409) await loadNext();
    }
  }

  async function skip() {
    if (busy || !current) return;
    busy = true;
    setLevelsEnabled(false);
    try {
      await postWithRetry("/api/skip", { submission_id: submissionId, annotator, pair_id: current.pair_id });
      setStatus("Skipped.", "ok");
      busy = false;
      await loadNext();
    } catch (err) {
      setStatus("Not skipped: " + err.message, "error");
      busy = false;
      setLevelsEnabled(true);
      if (err.status === 404 || err.status === 409) await loadNext();
    }
  }

  function updateCounter() {
    const n = $("comment").value.length;
    $("counter").textContent = n + " / " + config.max_comment;
  }

  // ------------------------------------------------------------ wiring

  function build() {
    const levels = $("levels");
    for (const [key, text] of Object.entries(config.levels)) {
      const b = el("button", "level level-" + key);
      b.type = "button";
      b.dataset.level = key;
      b.appendChild(el("kbd", null, key));
      b.appendChild(el("span", null, text));
      b.addEventListener("click", () => submit(parseInt(key, 10)));
      levels.appendChild(b);
    }
    if (config.criteria.length) {
      $("criteria-box").hidden = false;
      for (const c of config.criteria) {
        const label = el("label", "criterion");
        const box = el("input");
        box.type = "checkbox";
        box.value = c;
        label.appendChild(box);
        label.appendChild(document.createTextNode(" " + c));
        $("criteria").appendChild(label);
      }
    }
    $("comment").maxLength = config.max_comment;
    $("comment").addEventListener("input", updateCounter);
    $("comment").addEventListener("keydown", (e) => { if (e.key === "Escape") e.target.blur(); });
    $("skip").addEventListener("click", skip);
    $("reload").addEventListener("click", loadNext);
    $("raw").checked = localStorage.getItem(RAW_KEY) === "1";
    $("raw").addEventListener("change", () => {
      localStorage.setItem(RAW_KEY, $("raw").checked ? "1" : "0");
      if (current) { show($("prompt"), current.prompt); show($("left"), current.left); show($("right"), current.right); }
    });
    $("change-name").addEventListener("click", () => {
      $("name").value = annotator || "";
      screen("signin");
      $("name").focus();
    });
    $("signin-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const name = $("name").value.trim();
      if (!name) return;
      annotator = name;
      localStorage.setItem(NAME_KEY, name);
      loadNext();
    });
    document.addEventListener("keydown", (e) => {
      if ($("task").hidden || e.ctrlKey || e.metaKey || e.altKey) return;
      const t = e.target;
      if (t && (t.tagName === "TEXTAREA" || (t.tagName === "INPUT" && t.type !== "checkbox"))) return;
      if (e.key >= "1" && e.key <= "5") { e.preventDefault(); submit(parseInt(e.key, 10)); }
      else if (e.key === "s" || e.key === "S") { e.preventDefault(); skip(); }
    });
    updateCounter();
  }

  build();
  if (annotator) loadNext();
  else { screen("signin"); $("name").focus(); }
})();
