// Drive Debian's Chromium (headless, through playwright-core) over one language of the built
// site, served on 127.0.0.1, as a reader would use it; print what it saw as JSON for
// tests/test_site.py to judge. One run per language:
//     node browser.mjs '{"base": "http://127.0.0.1:8000", "lang": "fr", "pages": [...], ...}'
// Per page, at 1280 px and at 390 px (a phone): the switcher's links, axe-core's critical and
// serious violations, horizontal overflow, every visible interface string (text outside the
// page body, accessible names, tooltips) and words broken across lines (at 390 px in a wide
// font too). Per language: searches, the copy button, the tabs, the switcher keeping the
// section, and (with "redirects") the root page's choice of language by the browser's. Every
// request that leaves 127.0.0.1 is reported.
import { createRequire } from "node:module";
import { chromium } from "playwright-core";

const require = createRequire(import.meta.url);
const AXE = require.resolve("axe-core/axe.min.js");
const config = JSON.parse(process.argv[2]);
const { base, lang } = config;

const browser = await chromium.launch({
  executablePath: config.chromium || "/usr/bin/chromium",
  headless: true,
  args: [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
  ],
});
const outside = [];
async function newContext(options = {}) {
  const context = await browser.newContext({ viewport: { width: 1280, height: 900 }, ...options });
  context.on("request", (request) => {
    const url = new URL(request.url());
    if (!["data:", "blob:"].includes(url.protocol) && url.hostname !== "127.0.0.1") {
      outside.push(request.url());
    }
  });
  return context;
}

// Text a reader sees or hears outside the page body: visible text nodes, accessible names
// (aria-label, title, placeholder) and the copy buttons' tooltips.
function interfaceStrings() {
  const found = new Set();
  const article = document.querySelector("article[role=main]");
  const visible = (el) => el && el.checkVisibility({ visibilityProperty: true, opacityProperty: false });
  // Visible text nodes; a name split by <wbr> (DistributedDataParallel) counts as one.
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  let last = null;
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    const el = node.parentElement;
    const text = node.textContent.replace(/\s+/g, " ").trim();
    if (!text || (article && article.contains(node))) continue;
    if (el.closest("script, style, noscript, code, kbd, samp") || !visible(el)) continue;
    if (last && node.previousSibling && node.previousSibling.nodeName === "WBR") {
      found.delete(last);
      last += text;
    } else {
      last = text;
    }
    found.add(last);
  }
  for (const el of document.querySelectorAll("[aria-label], [title], [placeholder], [data-tooltip]")) {
    if (article && article.contains(el) && !el.matches("[data-tooltip]")) continue;
    for (const name of ["aria-label", "title", "placeholder", "data-tooltip"]) {
      const value = el.getAttribute(name);
      if (value && value.trim()) found.add(value.trim());
    }
  }
  return [...found];
}

// Words drawn across two lines in headings and the sidebars: a name (DistributedDataParallel)
// may wrap only where the site put <wbr>, a katakana word (インストール) not at all. With wide,
// the same with those drawn in DejaVu Sans, as wide as a reader's phone font can be, whatever
// fonts this machine has; Chinese and Japanese keep their font (DejaVu Sans has none of theirs).
function brokenWords(wide = false) {
  const selector = ".sidebar-tree a, .toc-tree a, article h1, article h2";
  const style = document.createElement("style");
  if (wide) {
    style.textContent = `${selector} { font-family: "DejaVu Sans", var(--font-stack) !important; }`;
    document.head.append(style);
  }
  const broken = [];
  for (const el of document.querySelectorAll(selector)) {
    if (!el.checkVisibility()) continue;
    const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const match of node.textContent.matchAll(/[A-Za-z]{4,}|[\u30A1-\u30FC]{3,}/g)) {
        const range = document.createRange();
        range.setStart(node, match.index);
        range.setEnd(node, match.index + match[0].length);
        const lines = new Set([...range.getClientRects()].map((r) => Math.round(r.top)));
        if (lines.size > 1) broken.push(wide ? `${match[0]} (in DejaVu Sans)` : match[0]);
      }
    }
  }
  style.remove();
  return broken;
}

async function checkPage(context, name) {
  const page = await context.newPage();
  const errors = [];
  page.on("pageerror", (error) => errors.push(String(error)));
  await page.goto(`${base}/${lang}/${name}.html`, { waitUntil: "load" });
  const result = { page: name, errors };
  result.switcher = await page.$$eval(".language-switcher a", (links) =>
    links.filter((a) => a.checkVisibility()).map((a) => a.getAttribute("hreflang")));
  result.strings = await page.evaluate(interfaceStrings);
  result.broken = await page.evaluate(brokenWords);
  await page.addScriptTag({ path: AXE });
  // Colour contrast comes from the stylesheet, the same in every language (custom.css changes
  // no colour by language): checked where config.contrast says (English), as it costs a third
  // of axe's time.
  result.axe = await page.evaluate(async (contrast) => {
    const rules = { "color-contrast": { enabled: contrast } };
    const report = await window.axe.run(document, { resultTypes: ["violations"], rules });
    return report.violations
      .filter((v) => ["critical", "serious"].includes(v.impact))
      .map((v) => ({ id: v.id, impact: v.impact, nodes: v.nodes.slice(0, 3).map((n) => n.target.join(" ")) }));
  }, Boolean(config.contrast));
  await page.setViewportSize({ width: 390, height: 844 });
  await page.waitForTimeout(50);
  result.overflow = await page.evaluate(() => {
    const root = document.documentElement;
    const wide = [...document.querySelectorAll("body *")]
      .filter((el) => el.getBoundingClientRect().right > root.clientWidth + 1 && el.checkVisibility())
      .filter((el) => !el.closest(".table-wrapper, .benchmark-chart-scroll, .highlight, .sidebar-drawer, .toc-drawer"))
      .slice(0, 3).map((el) => `${el.tagName.toLowerCase()}.${el.className}`);
    return { scroll: root.scrollWidth - root.clientWidth, wide };
  });
  result.phoneStrings = await page.evaluate(interfaceStrings);
  // On the phone: the smallest chart text as drawn (px), and every region that scrolls
  // sideways: reachable by keyboard, and (tables, charts) showing a shadow where more is.
  result.phone = await page.evaluate(() => ({
    chartText: [...document.querySelectorAll("svg.benchmark-chart")].map((svg) => {
      const scale = svg.getBoundingClientRect().width / svg.viewBox.baseVal.width;
      return Math.min(...[...svg.querySelectorAll("text")].map((t) => parseFloat(getComputedStyle(t).fontSize) * scale));
    }),
    scrollers: [...document.querySelectorAll(".table-wrapper, .benchmark-chart-scroll, pre")]
      .filter((el) => el.scrollWidth > el.clientWidth + 1 && el.checkVisibility())
      .map((el) => ({
        what: el.tagName === "PRE" ? "code" : el.className,
        focusable: el.tabIndex >= 0,
        shadow: el.tagName === "PRE" || getComputedStyle(el).backgroundImage.includes("gradient"),
      })),
  }));
  result.broken.push(...(await page.evaluate(brokenWords)));
  result.broken.push(...(await page.evaluate(brokenWords, true)));
  await page.close();
  return result;
}

async function search(context, query) {
  const page = await context.newPage();
  await page.goto(`${base}/${lang}/search.html?q=${encodeURIComponent(query)}`, { waitUntil: "load" });
  await page.waitForFunction(() => {
    const summary = document.querySelector("#search-results .search-summary");
    return summary && summary.innerText.trim() !== "";
  }, null, { timeout: 20000 });
  const found = await page.evaluate(() => ({
    summary: document.querySelector("#search-results .search-summary").innerText.trim(),
    pages: [...document.querySelectorAll("#search-results ul.search li a")].map((a) =>
      new URL(a.href).pathname.replace(/^.*?\/(?:en|zh_CN|ja|fr)\//, "").replace(/\.html$/, "")),
  }));
  await page.close();
  return { query, ...found };
}

async function copyButton(context) {
  await context.grantPermissions(["clipboard-read", "clipboard-write"], { origin: base });
  const page = await context.newPage();
  await page.goto(`${base}/${lang}/${config.copyPage}.html`, { waitUntil: "load" });
  const block = page.locator("article div.highlight-console").first();
  const shown = await block.locator("pre").innerText();
  await block.hover();
  const button = block.locator("button.copybtn");
  const tooltip = await button.getAttribute("data-tooltip");
  await button.click();
  await page.waitForTimeout(100);
  const afterClick = await button.getAttribute("data-tooltip");
  const copied = await page.evaluate(() => navigator.clipboard.readText());
  await page.close();
  return { shown, copied, tooltip, afterClick };
}

async function tabs(context) {
  const page = await context.newPage();
  await page.goto(`${base}/${lang}/${config.tabsPage}.html`, { waitUntil: "load" });
  const group = page.locator("article .sphinx-tabs").first();
  const buttons = group.locator("[role=tab]");
  const panels = group.locator("[role=tabpanel]");
  const state = async () => ({
    selected: await buttons.evaluateAll((b) => b.map((x) => x.getAttribute("aria-selected") === "true")),
    shown: await panels.evaluateAll((p) => p.map((x) => !x.hidden && x.checkVisibility())),
  });
  const before = await state();
  await buttons.nth(0).click();
  const againFirst = await state();
  await buttons.nth(1).click();
  const second = await state();
  await page.close();
  return { before, againFirst, second };
}

async function switcherKeepsSection(context) {
  const page = await context.newPage();
  const [name, anchor] = config.sectionLink;
  await page.goto(`${base}/${lang}/${name}.html#${anchor}`, { waitUntil: "load" });
  const other = lang === "en" ? "fr" : "en";
  await page.locator(`.language-switcher a[hreflang=${other}]`).click();
  await page.waitForLoadState("load");
  const url = page.url();
  await page.close();
  return url.slice(base.length);
}

async function redirects() {
  const landed = {};
  for (const locale of ["zh-CN", "ja-JP", "fr-FR", "en-US", "de-DE"]) {
    const context = await newContext({ locale });
    const page = await context.newPage();
    await page.goto(`${base}/index.html`);
    await page.waitForURL(/\/(en|zh_CN|ja|fr)\/index\.html$/, { timeout: 10000 });
    landed[locale] = new URL(page.url()).pathname;
    await context.close();
  }
  return landed;
}

const result = { lang, pages: [], searches: [] };
const context = await newContext();
for (const name of config.pages) result.pages.push(await checkPage(context, name));
for (const query of config.searches) result.searches.push(await search(context, query));
result.copy = await copyButton(context);
result.tabs = await tabs(context);
result.section = await switcherKeepsSection(context);
await context.close();
if (config.redirects) result.redirects = await redirects();
result.outside = [...new Set(outside)];
await browser.close();
console.log(JSON.stringify(result));
