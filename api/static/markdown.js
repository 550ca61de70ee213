// A small, safe markdown renderer for the chat page: the text is HTML-escaped first, then a few
// constructs are formatted (paragraphs, headings, lists, code fences with their language, inline
// code, bold/italic, http(s)/mailto links). Loaded before app.js, which uses renderMarkdown.
"use strict";

function escapeHtml(text) {
  const entities = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  return String(text).replace(/\u0000/g, "").replace(/[&<>"']/g, (c) => entities[c]);
}

// Inline spans on already-escaped text. Code spans and links become placeholders first, so
// emphasis never reaches inside them.
function inline(raw) {
  const held = [];
  const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
  let s = escapeHtml(raw).replace(/`([^`]+)`/g, (_, code) => hold(`<code>${code}</code>`));
  s = s.replace(/\[([^\]]+)\]\(([^)\s]+)\)/g, (all, label, url) =>
    /^(https?:\/\/|mailto:|\/|#)/i.test(url)
      ? hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`)
      : all,
  );
  s = s.replace(/\*\*(\S(?:[^*]*\S)?)\*\*/g, "<strong>$1</strong>").replace(/__(\S(?:[^_]*\S)?)__/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^*\w])\*(\S(?:[^*]*\S)?)\*(?!\w)/g, "$1<em>$2</em>");
  s = s.replace(/(^|[^_\w])_(\S(?:[^_]*\S)?)_(?!\w)/g, "$1<em>$2</em>");
  return s.replace(/\u0000(\d+)\u0000/g, (_, n) => held[Number(n)]);
}

const FENCE = /^\s*(```|~~~)\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const ITEM = /^\s*([-*+]|(\d{1,9})[.)])\s+/;

function renderMarkdown(source) {
  const lines = String(source).replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const body = [];
      i++;
      while (i < lines.length && !lines[i].trim().startsWith(fence[1])) body.push(lines[i++]);
      i++; // the closing fence (absent while the block is still streaming)
      const label = fence[2] ? `<span class="code-lang">${escapeHtml(fence[2])}</span>` : "";
      out.push(`<div class="code-block">${label}<pre><code>${escapeHtml(body.join("\n"))}</code></pre></div>`);
    } else if (!line.trim()) {
      i++;
    } else if (HEADING.test(line)) {
      const [, hashes, text] = line.match(HEADING);
      const level = Math.min(6, hashes.length + 2); // the page's own headings come first
      out.push(`<h${level}>${inline(text)}</h${level}>`);
      i++;
    } else if (ITEM.test(line)) {
      const ordered = Boolean(line.match(ITEM)[2]);
      const start = ordered ? Number(line.match(ITEM)[2]) : 1;
      const items = [];
      while (i < lines.length && ITEM.test(lines[i]) && Boolean(lines[i].match(ITEM)[2]) === ordered) {
        items.push(`<li>${inline(lines[i++].replace(ITEM, ""))}</li>`);
      }
      out.push(ordered ? `<ol start="${start}">${items.join("")}</ol>` : `<ul>${items.join("")}</ul>`);
    } else {
      const paragraph = [lines[i++]];
      while (i < lines.length && lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i]) && !ITEM.test(lines[i])) {
        paragraph.push(lines[i++]);
      }
      out.push(`<p>${paragraph.map(inline).join("<br>")}</p>`);
    }
  }
  return out.join("");
}
