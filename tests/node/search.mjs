// Run Sphinx's own in-browser search code (language_data.js, then searchtools.js) on a
// built site's searchindex.js, as a browser would, and print the documents a query finds.
//     node search.mjs _build/html/fr "conteneur"      ->  ["getting-started/install", ...]
import fs from "node:fs";
import path from "node:path";
import vm from "node:vm";

const [site, query] = process.argv.slice(2);
const element = new Proxy({}, { get: (target, name) => (name in target ? target[name] : () => element) });
element.lastChild = null;
element.classList = { add() {} };
const context = {
  console,
  URLSearchParams,
  localStorage: { setItem() {} },
  SPHINX_HIGHLIGHT_ENABLED: false,
  _ready: () => {},
  document: {
    getElementById: () => element,
    createElement: () => element,
    documentElement: { dataset: {} },
  },
};
context.window = context;
vm.createContext(context);
for (const file of ["_static/language_data.js", "_static/searchtools.js", "searchindex.js"]) {
  vm.runInContext(fs.readFileSync(path.join(site, file), "utf8"), context, { filename: file });
}
const found = vm.runInContext(
  `(() => {
     const [q, terms, excluded, highlight, objects] = Search._parseQuery(${JSON.stringify(query)});
     return Search._performSearch(q, terms, excluded, highlight, objects).map((r) => r[0]);
   })()`,
  context,
);
console.log(JSON.stringify([...new Set(found)]));
