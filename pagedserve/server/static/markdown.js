// A small, safe Markdown renderer for model output.
// Safety: model text only ever reaches the page through document.createTextNode /
// textContent; no innerHTML, and links are kept only for http(s) URLs. So a reply that
// contains <script> or <img onerror=...> shows those characters and runs nothing.
// Covers what chat replies use: fenced code blocks, headings, bullet and numbered lists,
// paragraphs with line breaks, `code`, **bold**, *italic*, [links](https://...).
"use strict";

const Markdown = (() => {
  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  // Inline spans, left to right: the earliest match wins; text between matches is text.
  const INLINE = [
    { re: /`([^`\n]+)`/, make: (m) => el("code", null, m[1]) },
    { re: /\*\*([^*\n]+)\*\*/, make: (m) => withInline(el("strong"), m[1]) },
    { re: /(?:^|(?<=[\s(]))\*([^*\s][^*\n]*)\*/, make: (m) => withInline(el("em"), m[1]) },
    { re: /\[([^\]\n]+)\]\((https?:\/\/[^\s)]+)\)/, make: (m) => link(m[1], m[2]) },
  ];

  function link(text, href) {
    const a = el("a", null, text);
    a.href = href; // only http(s), by the regex above
    a.rel = "noopener noreferrer nofollow";
    a.target = "_blank";
    return a;
  }

  function withInline(parent, text) {
    let rest = text;
    while (rest.length) {
      let best = null;
      for (const rule of INLINE) {
        const m = rule.re.exec(rest);
        if (m && (best === null || m.index < best.m.index)) best = { m, rule };
      }
      if (best === null) {
        parent.appendChild(document.createTextNode(rest));
        break;
      }
      if (best.m.index > 0) parent.appendChild(document.createTextNode(rest.slice(0, best.m.index)));
      parent.appendChild(best.rule.make(best.m));
      rest = rest.slice(best.m.index + best.m[0].length);
    }
    return parent;
  }

  function paragraph(lines) {
    const p = el("p");
    lines.forEach((line, i) => {
      if (i) p.appendChild(el("br"));
      withInline(p, line);
    });
    return p;
  }

  // Returns a DocumentFragment for `text`. An unclosed ``` fence (a reply still streaming)
  // renders as a code block up to the end.
  function render(text) {
    const out = document.createDocumentFragment();
    const lines = text.split("\n");
    let i = 0;
    let para = [];
    const flush = () => {
      if (para.length) out.appendChild(paragraph(para));
      para = [];
    };
    while (i < lines.length) {
      const line = lines[i];
      const fence = /^\s*```\s*([\w+-]*)\s*$/.exec(line);
      if (fence) {
        flush();
        const body = [];
        i++;
        while (i < lines.length && !/^\s*```\s*$/.test(lines[i])) body.push(lines[i++]);
        i++; // the closing fence
        const pre = el("pre");
        const code = el("code", fence[1] ? "lang-" + fence[1] : null, body.join("\n"));
        pre.appendChild(code);
        out.appendChild(pre);
        continue;
      }
      const heading = /^(#{1,4})\s+(.*)$/.exec(line);
      if (heading) {
        flush();
        out.appendChild(withInline(el("h" + (heading[1].length + 2)), heading[2]));
        i++;
        continue;
      }
      const item = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(line);
      if (item) {
        flush();
        const ordered = /\d/.test(item[1]);
        const list = el(ordered ? "ol" : "ul");
        while (i < lines.length) {
          const m = /^\s*([-*+]|\d+[.)])\s+(.*)$/.exec(lines[i]);
          if (!m || /\d/.test(m[1]) !== ordered) break;
          list.appendChild(withInline(el("li"), m[2]));
          i++;
        }
        out.appendChild(list);
        continue;
      }
      if (line.trim() === "") flush();
      else para.push(line);
      i++;
    }
    flush();
    return out;
  }

  return { render };
})();
