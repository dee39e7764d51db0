// A small Markdown renderer for model output. Every piece of source text is HTML-escaped before
// any markup is added, so what the model writes can never become elements or scripts.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const SAFE_HREF = /^(https?:\/\/|mailto:|\/|#)/i;
const FENCE = /^\s*(`{3,}|~{3,})\s*([^\s`]*)/;
const HEADING = /^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^\s{0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^\s{0,3}>\s?/;
const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

export function renderMarkdown(source) {
  const lines = source.replace(/\r\n?/g, "\n").replace(/\u0000/g, "").split("\n");
  return renderBlocks(lines);
}

function renderBlocks(lines) {
  const html = [];
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      const closing = new RegExp(`^\\s*${fence[1][0] === "`" ? "`" : "~"}{${fence[1].length},}\\s*$`);
      const body = [];
      for (i += 1; i < lines.length && !closing.test(lines[i]); i += 1) body.push(lines[i]);
      i += 1;
      html.push(codeBlock(body.join("\n"), fence[2]));
      continue;
    }
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const heading = line.match(HEADING);
    if (heading) {
      const level = heading[1].length;
      html.push(`<h${level}>${renderInline(heading[2])}</h${level}>`);
      i += 1;
      continue;
    }
    if (RULE.test(line)) {
      html.push("<hr>");
      i += 1;
      continue;
    }
    if (QUOTE.test(line)) {
      const quoted = [];
      for (; i < lines.length && QUOTE.test(lines[i]); i += 1) quoted.push(lines[i].replace(QUOTE, ""));
      html.push(`<blockquote>${renderBlocks(quoted)}</blockquote>`);
      continue;
    }
    if (LIST_ITEM.test(line)) {
      i = renderList(lines, i, html);
      continue;
    }
    const paragraph = [];
    for (; i < lines.length && lines[i].trim() && !startsBlock(lines[i]); i += 1) paragraph.push(lines[i].trim());
    html.push(`<p>${paragraph.map(renderInline).join("<br>")}</p>`);
  }
  return html.join("\n");
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || LIST_ITEM.test(line);
}

function codeBlock(code, language) {
  const label = language ? escapeHtml(language) : "text";
  return `<div class="code-block"><div class="code-header"><span class="code-lang">${label}</span>` +
    `<button type="button" class="copy-code">Copy</button></div><pre><code>${escapeHtml(code)}</code></pre></div>`;
}

// One list and the lines that continue its items; returns the index of the first line after it.
function renderList(lines, start, html) {
  const first = lines[start].match(LIST_ITEM);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const items = [];
  let i = start;
  while (i < lines.length) {
    const item = lines[i].match(LIST_ITEM);
    if (item && item[1].length <= indent) {
      if (/\d/.test(item[2]) !== ordered) break;
      items.push([item[3]]);
      i += 1;
    } else if (!lines[i].trim()) {
      const next = lines[i + 1] ?? "";
      if (!(LIST_ITEM.test(next) || indentOf(next) > indent)) break;
      items[items.length - 1].push("");
      i += 1;
    } else if (indentOf(lines[i]) > indent) {
      items[items.length - 1].push(lines[i]);
      i += 1;
    } else {
      break;
    }
  }
  const tag = ordered ? "ol" : "ul";
  const number = parseInt(first[2], 10);
  const startAttribute = ordered && number !== 1 ? ` start="${number}"` : "";
  const rendered = items.map(([head, ...rest]) => {
    const more = rest.some((line) => line.trim()) ? renderBlocks(dedent(rest)) : "";
    return `<li>${renderInline(head)}${more}</li>`;
  });
  html.push(`<${tag}${startAttribute}>${rendered.join("")}</${tag}>`);
  return i;
}

function indentOf(line) {
  return line.match(/^\s*/)[0].length;
}

function dedent(lines) {
  const depth = Math.min(...lines.filter((line) => line.trim()).map(indentOf));
  return lines.map((line) => line.slice(depth));
}

// Code spans and links are set aside as placeholders, so that emphasis never reaches into them.
export function renderInline(text) {
  const kept = [];
  const keep = (html) => `\u0000${kept.push(html) - 1}\u0000`;
  let out = text.replace(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g, (_, ticks, code) =>
    keep(`<code>${escapeHtml(code.trim() ? code.replace(/^ (.*) $/, "$1") : code)}</code>`));
  out = out.replace(/\[([^\]\n]+)\]\(\s*([^\s)]+)\s*\)/g, (whole, label, href) =>
    SAFE_HREF.test(href)
      ? keep(`<a href="${escapeHtml(href)}" target="_blank" rel="noopener noreferrer">${emphasis(escapeHtml(label))}</a>`)
      : whole);
  out = emphasis(escapeHtml(out));
  return out.replace(/\u0000(\d+)\u0000/g, (_, index) => kept[Number(index)]);
}

function emphasis(html) {
  return html
    .replace(/(\*\*|__)(?=\S)([\s\S]*?\S)\1/g, "<strong>$2</strong>")
    .replace(/\*(?=[^\s*])([^*]*?[^\s*])\*/g, "<em>$1</em>")
    .replace(/\*(?=[^\s*])([^*])\*/g, "<em>$1</em>")
    .replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_]|[^\s_])_(?!\w)/g, "$1<em>$2</em>")
    .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
}
