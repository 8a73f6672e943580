// tandem chat: the conversation lives in this tab; each reply streams from
// /v1/chat/completions (fetch + ReadableStream); stop aborts the fetch, and the server
// cancels the generation when the connection closes. Model output is shown through
// markdown.js, which escapes it; a thought (reasoning_content) is folded in <details>.
"use strict";

(function () {
  const KEY_STORAGE = "tandem-api-key";
  const byId = (id) => document.getElementById(id);
  // From the origin: a page opened as http://user:key@host/chat may not fetch relative URLs
  // (they would carry the credentials).
  const apiUrl = (path) => new URL(path, location.origin).href;
  const messages = byId("messages");
  const prompt = byId("prompt");
  const sendButton = byId("send");
  const stopButton = byId("stop");
  const modelSelect = byId("model");
  const keyForm = byId("key-form");
  const statusLine = byId("status");
  const conversation = []; // {role, content}: what the next request sends
  let running = null; // the AbortController of the reply streaming now

  function setState(state) {
    document.body.dataset.state = state;
    sendButton.disabled = state !== "ready";
    stopButton.disabled = state !== "streaming";
  }

  function requestHeaders() {
    const headers = { "Content-Type": "application/json" };
    const key = sessionStorage.getItem(KEY_STORAGE);
    if (key) headers.Authorization = "Bearer " + key;
    return headers;
  }

  async function errorText(response) {
    try {
      const body = await response.json();
      return (body.error && body.error.message) || response.statusText;
    } catch (error) {
      return response.statusText;
    }
  }

  function askForKey(message) {
    keyForm.hidden = false;
    statusLine.textContent = message;
    setState("key");
    byId("key").focus();
  }

  async function loadModels() {
    setState("loading");
    let response;
    try {
      response = await fetch(apiUrl("/v1/models"), { headers: requestHeaders() });
    } catch (error) {
      statusLine.textContent = "cannot reach the server: " + error.message;
      return;
    }
    if (response.status === 401) {
      askForKey(await errorText(response));
      return;
    }
    if (!response.ok) {
      statusLine.textContent = "/v1/models: " + (await errorText(response));
      return;
    }
    const models = (await response.json()).data || [];
    modelSelect.replaceChildren(
      ...models.map((model) => new Option(model.id, model.id))
    );
    keyForm.hidden = true;
    statusLine.textContent = "";
    setState("ready");
  }

  // One message on the page; `update` redraws it from its whole text so far.
  function addMessage(role) {
    const element = document.createElement("article");
    element.className = "message " + role;
    const label = document.createElement("div");
    label.className = "role";
    label.textContent = role;
    const body = document.createElement("div");
    body.className = "content";
    const note = document.createElement("div");
    note.className = "note";
    element.append(label, body, note);
    messages.append(element);
    let details = null;

    function update(content, reasoning) {
      if (role === "user") {
        body.textContent = content;
      } else {
        body.innerHTML = window.tandemMarkdown.renderMarkdown(content);
      }
      if (reasoning && !details) {
        details = document.createElement("details"); // folded until the reader opens it
        const summary = document.createElement("summary");
        summary.textContent = "thinking";
        const thought = document.createElement("div");
        thought.className = "thought";
        details.append(summary, thought);
        element.insertBefore(details, body);
      }
      if (details) details.querySelector(".thought").textContent = reasoning;
      element.scrollIntoView({ block: "end" });
    }

    function setNote(text, isError) {
      note.textContent = text;
      note.className = isError ? "note error" : "note";
    }

    return { element: element, update: update, setNote: setNote };
  }

  // Server-sent events out of a fetch body: yields each event's parsed data.
  async function* serverEvents(response) {
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (data && data !== "[DONE]") yield JSON.parse(data);
      }
    }
  }

  function requestBody() {
    const body = {
      model: modelSelect.value,
      messages: conversation.slice(),
      stream: true,
      stream_options: { include_usage: true },
    };
    const maxTokens = byId("max-tokens").value;
    if (maxTokens) body.max_tokens = Number(maxTokens);
    const temperature = byId("temperature").value;
    if (temperature !== "") body.temperature = Number(temperature);
    if (!byId("thinking").checked) body.reasoning_effort = "none";
    return body;
  }

  async function send(text) {
    if (running || !text.trim()) return;
    conversation.push({ role: "user", content: text });
    addMessage("user").update(text, "");
    const reply = addMessage("assistant");
    running = new AbortController();
    setState("streaming");
    document.body.dataset.deltas = "0";
    let content = "";
    let reasoning = "";
    let finish = null;
    let usage = null;
    let failed = false;
    try {
      const response = await fetch(apiUrl("/v1/chat/completions"), {
        method: "POST",
        headers: requestHeaders(),
        body: JSON.stringify(requestBody()),
        signal: running.signal,
      });
      if (!response.ok) throw new Error(await errorText(response));
      for await (const chunk of serverEvents(response)) {
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const choice of chunk.choices || []) {
          const delta = choice.delta || {};
          reasoning += delta.reasoning_content || "";
          content += delta.content || "";
          finish = choice.finish_reason || finish;
        }
        document.body.dataset.deltas = String(Number(document.body.dataset.deltas) + 1);
        reply.update(content, reasoning);
      }
      const counted = usage ? " · " + usage.completion_tokens + " tokens" : "";
      reply.setNote((finish || "ended") + counted, false);
    } catch (error) {
      failed = error.name !== "AbortError";
      reply.setNote(failed ? "error: " + error.message : "stopped", failed);
    } finally {
      running = null;
      reply.update(content, reasoning);
      if (failed) {
        conversation.pop(); // the turn that failed is not sent again
      } else {
        conversation.push({ role: "assistant", content: content });
      }
      setState("ready");
    }
  }

  function stop() {
    if (running) running.abort();
  }

  // A whole message drawn without a request (a test, or history from elsewhere).
  function show(message) {
    const view = addMessage(message.role);
    view.update(message.content || "", message.reasoning_content || "");
    return view.element;
  }

  function clear() {
    stop();
    conversation.length = 0;
    messages.replaceChildren();
  }

  byId("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = prompt.value;
    prompt.value = "";
    send(text);
  });
  prompt.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      byId("composer").requestSubmit();
    }
  });
  stopButton.addEventListener("click", stop);
  byId("clear").addEventListener("click", clear);
  keyForm.addEventListener("submit", (event) => {
    event.preventDefault();
    sessionStorage.setItem(KEY_STORAGE, byId("key").value);
    loadModels();
  });

  window.tandemChat = {
    send: send,
    stop: stop,
    show: show,
    clear: clear,
    conversation: conversation,
    renderMarkdown: window.tandemMarkdown.renderMarkdown,
  };
  loadModels();
})();
