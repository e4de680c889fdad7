// TriForce Studio: a click on a token of an answer opens it in the inspector. Each token carries
// data-tf="turn:segment"; the key goes to the hidden #tf-pick box, whose change event runs the
// inspector's handler (with a nonce, so a second click on the same token fires again).
document.addEventListener("click", (event) => {
  const token = event.target.closest("#tf-chat [data-tf]");
  if (!token) return;
  const box = document.querySelector("#tf-pick textarea, #tf-pick input");
  if (!box) return;
  box.value = `${token.dataset.tf}@${Date.now()}`;
  box.dispatchEvent(new Event("input", { bubbles: true }));
  document.querySelectorAll("#tf-chat .tf-picked").forEach((el) => el.classList.remove("tf-picked"));
  token.classList.add("tf-picked");
});

// -- Big pastes (ui/pasting.py) ---------------------------------------------------------------------
// A paste (or a drop) that would take the chat box over its cap never reaches the box: what was
// typed stays, and the note beside the box says so and offers to read the text as the document.
// Its button puts the text in the hidden #tf-paste-text box and clicks the hidden #tf-paste-use
// button, whose handler reads it as an upload is read.
(() => {
  let pasted = "";
  const note = () => document.querySelector("#tf-paste-note .tf-paste-note");
  const cap = () => Number(note()?.dataset.max) || 20000;
  const count = (n) => n.toLocaleString("en-US");

  function offer(text, held) {
    const el = note();
    if (!el) return;
    pasted = text;
    const why = text.length > cap() ? "" : `; with the ${count(held)} already in the box, it is`;
    el.replaceChildren();
    const line = document.createElement("span");
    line.textContent = `That paste is ${count(text.length)} characters${why || ","} too long for a question ` +
      `(the limit is ${count(cap())}). Use it as the document?`;
    const use = document.createElement("button");
    use.type = "button";
    use.className = "tf-paste-use";
    use.textContent = "Use this text as the document";
    const dismiss = document.createElement("button");
    dismiss.type = "button";
    dismiss.className = "tf-paste-dismiss";
    dismiss.textContent = "Dismiss";
    el.append(line, use, dismiss);
  }

  function clear() {
    const el = note();
    pasted = "";
    if (el) el.replaceChildren();
  }

  // true when `text` arriving in `box` (over its selection) would take it over the cap
  function over(box, text) {
    const kept = box.value.length - Math.abs((box.selectionEnd ?? 0) - (box.selectionStart ?? 0));
    return kept + text.length > cap() ? kept : -1;
  }

  for (const [kind, data] of [["paste", "clipboardData"], ["drop", "dataTransfer"]]) {
    document.addEventListener(kind, (event) => {
      const box = event.target.closest?.("#tf-message textarea, #tf-message input");
      if (!box) return;
      const text = event[data]?.getData("text/plain") || "";
      const held = over(box, text);
      if (held < 0) return;
      event.preventDefault();
      offer(text, held);
    }, true);
  }

  document.addEventListener("click", (event) => {
    if (event.target.closest("#tf-paste-note .tf-paste-dismiss")) { clear(); return; }
    if (!event.target.closest("#tf-paste-note .tf-paste-use") || !pasted) return;
    const box = document.querySelector("#tf-paste-text textarea, #tf-paste-text input");
    const send = document.querySelector("#tf-paste-use");
    if (!box || !send) return;
    box.value = pasted;
    box.dispatchEvent(new Event("input", { bubbles: true }));
    const el = note();
    el.replaceChildren(`Reading the pasted text (${count(pasted.length)} characters) as the document…`);
    pasted = "";
    setTimeout(() => send.click(), 0);  // once the box's new value is the component's
  });
})();

// -- Dark mode ------------------------------------------------------------------------------------
// The header's #tf-theme button switches Gradio's dark theme (the `dark` class on the body, as
// Gradio's own ?__theme=dark sets it) and keeps the choice in this browser. Gradio sets its theme
// once the app has mounted (and again when the system's changes): a choice made here wins. The
// button's label and the charts' colours follow the class in app.css.
(() => {
  const KEY = "tf-theme";
  const chosen = () => { try { return localStorage.getItem(KEY); } catch { return null; } };
  const apply = (theme) => {
    const dark = theme === "dark";
    if (document.body.classList.contains("dark") !== dark) document.body.classList.toggle("dark", dark);
  };
  document.addEventListener("click", (event) => {
    if (!event.target.closest("#tf-theme")) return;
    const theme = document.body.classList.contains("dark") ? "light" : "dark";
    try { localStorage.setItem(KEY, theme); } catch { /* private mode: this page only */ }
    apply(theme);
  });
  const start = () => {
    if (chosen()) apply(chosen());
    new MutationObserver(() => { if (chosen()) apply(chosen()); })
      .observe(document.body, { attributes: true, attributeFilter: ["class"] });
  };
  if (document.body) start(); else document.addEventListener("DOMContentLoaded", start);
})();

// TriForce Studio: answers as Markdown (ui/answer_html.py). Copy buttons: an answer as Markdown
// (its source rides escaped in a <template class="tf-md">) or as plain text (what the page shows
// of it), a code block's code; through the Clipboard API, else a hidden textarea and
// execCommand("copy") where that API is missing or refused. The chat follows the newest answer
// as it streams, unless the person scrolled up to read: then it stays where they are. The
// transcript is redrawn whole while an answer streams, so an answer's open <details> (its rounds,
// its sources) are opened again after each redraw.
(() => {
  async function tfCopy(text) {
    try {
      if (navigator.clipboard && window.isSecureContext) {
        await navigator.clipboard.writeText(text);
        return true;
      }
    } catch (err) {
      // refused (no permission, the page not focused): the fallback below
    }
    const area = document.createElement("textarea");
    area.value = text;
    area.setAttribute("readonly", "");
    area.style.position = "fixed";
    area.style.top = "0";
    area.style.left = "0";
    area.style.opacity = "0";
    document.body.appendChild(area);
    area.select();
    let ok = false;
    try {
      ok = document.execCommand("copy");
    } catch (err) {
      ok = false;
    }
    area.remove();
    return ok;
  }

  function copied(button, ok) {
    const mark = ok ? "tf-copied" : "tf-copy-failed";
    button.classList.add(mark);
    const label = button.classList.contains("tf-copy-code") ? null : button.textContent;
    if (label !== null) button.textContent = ok ? "Copied" : "Copy failed";
    setTimeout(() => {
      button.classList.remove(mark);
      if (label !== null) button.textContent = label;
    }, 1500);
  }

  function copiedText(button) {
    if (button.classList.contains("tf-copy-code")) {
      const code = button.closest(".tf-code").querySelector("code");
      return code ? code.textContent : "";
    }
    const message = button.closest(".tf-assistant");
    if (!message) return "";
    if (button.classList.contains("tf-copy-md")) {
      const source = message.querySelector("template.tf-md");
      return source ? source.content.textContent : "";
    }
    const body = message.querySelector(".tf-answer-body");
    return body ? body.innerText.trim() : "";
  }

  document.addEventListener("click", async (event) => {
    const button = event.target.closest("#tf-chat .tf-copy-md, #tf-chat .tf-copy-text, #tf-chat .tf-copy-code");
    if (!button) return;
    event.preventDefault();
    copied(button, await tfCopy(copiedText(button)));
  });

  // Following the newest answer. `stuck`: the transcript is scrolled to its end (then it stays at
  // the end as the answer grows); else `top` is where the person left it.
  const follow = { stuck: true, top: 0, box: null, answers: 0 };
  document.addEventListener("scroll", (event) => {
    const box = event.target;
    if (!(box instanceof Element) || !box.matches("#tf-chat .tf-transcript")) return;
    follow.stuck = box.scrollHeight - box.scrollTop - box.clientHeight < 24;
    follow.top = box.scrollTop;
  }, true);

  // Open <details> of the answers, by the answer's place and the block's class.
  const opened = new Set();
  function detailsKey(details) {
    const message = details.closest(".tf-assistant");
    if (!message) return null;
    const all = [...document.querySelectorAll("#tf-chat .tf-assistant")];
    return `${all.indexOf(message)}:${details.className}`;
  }
  document.addEventListener("toggle", (event) => {
    const details = event.target;
    if (!(details instanceof HTMLDetailsElement) || !details.closest("#tf-chat")) return;
    const key = detailsKey(details);
    if (key === null) return;
    if (details.open) opened.add(key);
    else opened.delete(key);
  }, true);

  function redrawn() {
    const answers = document.querySelectorAll("#tf-chat .tf-assistant");
    if (answers.length === 0) opened.clear();
    if (opened.size) {
      document.querySelectorAll("#tf-chat .tf-assistant details:not([open])").forEach((details) => {
        if (opened.has(detailsKey(details))) details.open = true;
      });
    }
    const box = document.querySelector("#tf-chat .tf-transcript");
    if (!box) return;
    if (answers.length > follow.answers) follow.stuck = true; // a new question: show it and its answer
    follow.answers = answers.length;
    if (follow.stuck) box.scrollTop = box.scrollHeight;
    else if (box !== follow.box) box.scrollTop = follow.top;
    follow.box = box;
  }

  function watch() {
    const chat = document.querySelector("#tf-chat");
    if (!chat) {
      setTimeout(watch, 200);
      return;
    }
    new MutationObserver(redrawn).observe(chat, { childList: true, subtree: true, characterData: true });
    redrawn();
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", watch);
  else watch();
})();

// The round narration (ui/narration.py): every round in a list that scrolls. Each update redraws
// it; it follows the newest round unless the reader has scrolled up to an earlier one.
(() => {
  let follow = true, top = 0;
  document.addEventListener("scroll", (event) => {
    const list = event.target;
    if (!(list instanceof Element) || !list.matches("#tf-narration .tf-rounds")) return;
    follow = list.scrollTop + list.clientHeight >= list.scrollHeight - 4;
    top = list.scrollTop;
  }, true);
  const keep = () => {
    const list = document.querySelector("#tf-narration .tf-rounds");
    if (list) list.scrollTop = follow ? list.scrollHeight : top;
  };
  const start = () => {
    const panel = document.querySelector("#tf-narration");
    if (!panel) return setTimeout(start, 500);
    new MutationObserver(keep).observe(panel, { childList: true, subtree: true });
  };
  start();
})();

// Continue (ui/views.py `continue_button`): an answer stopped by its token limit carries a
// Continue button in the transcript's HTML; a click runs the hidden #tf-continue button's event
// (AnswerHandlers.on_continue), and the button goes at once so a second click cannot queue.
document.addEventListener("click", (event) => {
  const button = event.target.closest("#tf-chat .tf-continue");
  if (!button) return;
  const hidden = document.querySelector("#tf-continue");
  if (!hidden) return;
  button.disabled = true;
  hidden.click();
});
