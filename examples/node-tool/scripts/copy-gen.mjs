// Copies the TypeScript generated from proto/ (gen/ts, by scripts/generate.sh) into
// src/gen before tsc runs, so that the generated files resolve @bufbuild/protobuf from this
// package's node_modules. src/gen is a build artefact (.gitignore), never edited.
import { cpSync, rmSync } from "node:fs";
import { fileURLToPath } from "node:url";

const from = fileURLToPath(new URL("../../../gen/ts", import.meta.url));
const to = fileURLToPath(new URL("../src/gen", import.meta.url));
rmSync(to, { recursive: true, force: true });
cpSync(from, to, { recursive: true });
