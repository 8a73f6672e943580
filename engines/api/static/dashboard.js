// tandem dashboard: swap in the server-rendered fragments that arrive over SSE.
"use strict";

(function () {
  const live = document.getElementById("live");
  let updates = 0;

  function apply(event) {
    const message = JSON.parse(event.data);
    for (const [id, html] of Object.entries(message.fragments)) {
      const element = document.getElementById(id);
      if (element && element.innerHTML !== html) {
        element.innerHTML = html;
      }
    }
    updates += 1;
    document.body.dataset.updates = String(updates);
    live.textContent = "live · " + new Date().toLocaleTimeString();
    live.className = "live";
  }

  const source = new EventSource("/dashboard/events");
  source.addEventListener("update", apply);
  source.addEventListener("error", function () {
    live.textContent = "reconnecting…";
    live.className = "muted";
  });
})();
