// What the copy button of a built site puts on the clipboard: takes formatCopyText and its
// arguments (the prompt settings from conf.py) from the site's own _static/copybutton.js and
// applies them to code block texts.
//     node copy.mjs _build/html/en < blocks.json   ->  JSON list of copied texts
import fs from "node:fs";
import path from "node:path";
import vm from "node:vm";

const source = fs.readFileSync(path.join(process.argv[2], "_static/copybutton.js"), "utf8");

function extractFunction(name) {
  const start = source.indexOf(`function ${name}(`);
  if (start < 0) throw new Error(`no function ${name} in copybutton.js`);
  let depth = 0;
  for (let i = source.indexOf("{", start); i < source.length; i++) {
    if (source[i] === "{") depth++;
    if (source[i] === "}" && --depth === 0) return source.slice(start, i + 1);
  }
  throw new Error(`unbalanced braces in ${name}`);
}

const call = source.match(/return formatCopyText\(text, (.*)\)\s*$/m);
if (!call) throw new Error("no formatCopyText call in copybutton.js");
const context = vm.createContext({});
vm.runInContext(extractFunction("escapeRegExp") + extractFunction("formatCopyText"), context);
const blocks = JSON.parse(fs.readFileSync(0, "utf8"));
const copied = blocks.map((text) =>
  vm.runInContext(`formatCopyText(${JSON.stringify(text)}, ${call[1]})`, context),
);
console.log(JSON.stringify(copied));
