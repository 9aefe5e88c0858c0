// Dual build: dist/esm (ES modules) and dist/cjs (CommonJS), each with its own type declarations.
// Users' own setups decide which one loads (see TOOLCHAIN notes in the README), so both ship.
import { execFileSync } from 'node:child_process';
import { mkdirSync, rmSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
const tsc = join(root, 'node_modules', 'typescript', 'bin', 'tsc');

rmSync(join(root, 'dist'), { recursive: true, force: true });
for (const [project, format] of [
  ['tsconfig.build.json', 'module'],
  ['tsconfig.build.cjs.json', 'commonjs'],
]) {
  execFileSync(process.execPath, [tsc, '-p', join(root, project)], { stdio: 'inherit', cwd: root });
  const outDir = join(root, 'dist', format === 'module' ? 'esm' : 'cjs');
  mkdirSync(outDir, { recursive: true });
  // Each half declares its own module format, whatever the package root says.
  writeFileSync(join(outDir, 'package.json'), JSON.stringify({ type: format }, null, 2) + '\n');
}
