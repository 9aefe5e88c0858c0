// Compiles TypeScript folders of this repository with swc (decorators and their metadata on) into
// an output folder, keeping the layout, for plain-Node child processes of tests and benchmarks.
import { mkdirSync, readdirSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { dirname, join, relative } from 'node:path';
import { fileURLToPath } from 'node:url';
import { transformFileSync } from '@swc/core';

export const root = join(dirname(fileURLToPath(import.meta.url)), '..');

/** How this repository's TypeScript is transformed by swc, for Jest (@swc/jest) and for child processes alike. */
export const swcOptions = {
  jsc: {
    parser: { syntax: 'typescript', decorators: true },
    transform: { legacyDecorator: true, decoratorMetadata: true },
    target: 'es2022',
    keepClassNames: true,
  },
  module: { type: 'es6' },
  sourceMaps: 'inline',
};

export function compile(outDir, folders) {
  rmSync(outDir, { recursive: true, force: true });
  for (const folder of folders) compileTree(join(root, folder), outDir);
}

function compileTree(dir, outDir) {
  let entries;
  try {
    entries = readdirSync(dir);
  } catch {
    return;
  }
  for (const name of entries) {
    const path = join(dir, name);
    if (statSync(path).isDirectory()) compileTree(path, outDir);
    else if (name.endsWith('.ts') && !name.endsWith('.spec.ts') && !name.endsWith('.d.ts')) {
      const out = join(outDir, relative(root, path)).replace(/\.ts$/, '.js');
      const { code } = transformFileSync(path, swcOptions);
      mkdirSync(dirname(out), { recursive: true });
      writeFileSync(out, code);
    }
  }
}
