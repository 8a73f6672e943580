// tandem chat: a small markdown renderer for model output. Safe by construction: every
// character of the source is HTML-escaped first and only the tags below are added back;
// links keep only http(s) and mailto targets. Covers fenced and inline code, headings,
// lists, quotes, rules, bold, italic, strikethrough, links and paragraphs.
"use strict";

(function (root) {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const SAFE_LINK = /^(https?:\/\/|mailto:)/i;

  function escapeHtml(text) {
    return text.replace(/[&<>"']/g, (character) => ESCAPES[character]);
  }

  // Inline spans of one escaped line: code spans first (nothing inside them is formatted),
  // held out as numbered slots while the other patterns run.
  function inline(escaped) {
    const slots = [];
    const hold = (html) => "\u0000" + (slots.push(html) - 1) + "\u0000";
    let text = escaped.replace(/`([^`]+)`/g, (_, code) => hold("<code>" + code + "</code>"));
    text = text.replace(/\[([^\]]+)\]\(([^)\s]+)\)/g, (whole, label, target) => {
      const unescaped = target.replace(/&amp;/g, "&");
      if (!SAFE_LINK.test(unescaped)) return label;
      return hold('<a href="' + target + '" rel="noopener noreferrer" target="_blank">' +
        label + "</a>");
    });
    text = text
      .replace(/\*\*(?=\S)([^*]*\S)\*\*/g, "<strong>$1</strong>")
      .replace(/__(?=\S)([^_]*\S)__/g, "<strong>$1</strong>")
      .replace(/~~(?=\S)([^~]*\S)~~/g, "<del>$1</del>")
      .replace(/(^|[^*\w])\*(?=\S)([^*]*\S)\*(?![*\w])/g, "$1<em>$2</em>")
      .replace(/(^|[^_\w])_(?=\S)([^_]*\S)_(?![_\w])/g, "$1<em>$2</em>");
    return text.replace(/\u0000(\d+)\u0000/g, (_, index) => slots[Number(index)]);
  }

  const FENCE = /^\s*(```|~~~)\s*([\w+-]*)\s*$/;
  const HEADING = /^(#{1,6})\s+(.*?)\s*#*\s*$/;
  const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;
  const BULLET = /^\s*[-*+]\s+(.*)$/;
  const NUMBERED = /^\s*\d{1,9}[.)]\s+(.*)$/;
  const QUOTE = /^\s*&gt;\s?(.*)$/;

  // Blocks of escaped lines. An unclosed fence (a reply still streaming) runs to the end.
  function blocks(lines) {
    const html = [];
    let index = 0;
    while (index < lines.length) {
      const line = lines[index];
      const fence = FENCE.exec(line);
      if (fence) {
        const body = [];
        index += 1;
        while (index < lines.length && lines[index].trim() !== fence[1]) {
          body.push(lines[index]);
          index += 1;
        }
        index += 1;
        const language = fence[2] ? ' class="language-' + fence[2] + '"' : "";
        html.push("<pre><code" + language + ">" + body.join("\n") + "</code></pre>");
        continue;
      }
      if (!line.trim()) {
        index += 1;
        continue;
      }
      const heading = HEADING.exec(line);
      if (heading) {
        const level = heading[1].length;
        html.push("<h" + level + ">" + inline(heading[2]) + "</h" + level + ">");
        index += 1;
        continue;
      }
      if (RULE.test(line)) {
        html.push("<hr>");
        index += 1;
        continue;
      }
      if (QUOTE.test(line)) {
        const quoted = [];
        while (index < lines.length && QUOTE.test(lines[index])) {
          quoted.push(QUOTE.exec(lines[index])[1]);
          index += 1;
        }
        html.push("<blockquote>" + blocks(quoted) + "</blockquote>");
        continue;
      }
      const list = BULLET.test(line) ? [BULLET, "ul"] : NUMBERED.test(line) ? [NUMBERED, "ol"] : null;
      if (list) {
        const items = [];
        while (index < lines.length && list[0].test(lines[index])) {
          items.push("<li>" + inline(list[0].exec(lines[index])[1]) + "</li>");
          index += 1;
        }
        html.push("<" + list[1] + ">" + items.join("") + "</" + list[1] + ">");
        continue;
      }
      const paragraph = [];
      while (index < lines.length && lines[index].trim() && !startsBlock(lines[index])) {
        paragraph.push(inline(lines[index]));
        index += 1;
      }
      html.push("<p>" + paragraph.join("<br>") + "</p>");
    }
    return html.join("");
  }

  function startsBlock(line) {
    return [FENCE, HEADING, RULE, BULLET, NUMBERED, QUOTE].some((pattern) => pattern.test(line));
  }

  function renderMarkdown(source) {
    // NUL marks the held-out spans, so the source may not carry it.
    const text = String(source).replace(/\u0000/g, "\uFFFD");
    return blocks(escapeHtml(text).split(/\r?\n/));
  }

  root.tandemMarkdown = { renderMarkdown: renderMarkdown, escapeHtml: escapeHtml };
})(window);
