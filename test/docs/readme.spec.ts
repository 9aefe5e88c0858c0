import { describe, expect, it } from '@jest/globals';
import { spawnSync } from 'node:child_process';
import { mkdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { repoRoot as root } from '../support/paths.js';

/**
 * Every TypeScript block of the README type-checks against the library's source. Blocks with
 * imports are modules (named by their `// name.ts` first line, so they may import each other);
 * other blocks are fragments: a decorated class gets the common imports, method fragments are
 * wrapped in a class, statements in a method. Names a fragment uses without defining (`locks`,
 * `db`, `id`...) are declared once, in ambient.d.ts below.
 */
const work = join(root, '.tmp', 'readme-check');

const commonImports = `import { Body, Controller, Get, Injectable, Module, Param, ParseIntPipe, Post, Put } from '@nestjs/common';
import { Cron, CronExpression } from '@nestjs/schedule';
import { Test } from '@nestjs/testing';
import { Locked, LOCK_MODULE_OPTIONS, LockModule, LockNotAcquiredError, LockService, LockTestingModule } from 'nestjs-locked';
`;

const ambient = `declare const locks: import('nestjs-locked').LockService;
declare const id: string;
declare const from: string;
declare const to: string;
declare const amount: number;
declare const total: number;
declare const batches: unknown[];
declare const db: { query(sql: string, params: unknown[]): Promise<{ rowCount: number }> };
declare function buildReport(signal: AbortSignal): Promise<void>;
declare function importBatch(batch: unknown, options: { signal: AbortSignal }): Promise<void>;
declare class ConfigModule {}
declare class ConfigService { getOrThrow(key: string): string; }
declare class OrdersModule {}
declare class AppModule {}
declare class Doc {}
`;

function blocks(): { code: string; line: number }[] {
  const text = readFileSync(join(root, 'README.md'), 'utf8');
  const found: { code: string; line: number }[] = [];
  const fence = /```ts\n([\s\S]*?)```/g;
  for (let m = fence.exec(text); m; m = fence.exec(text)) found.push({ code: m[1]!, line: text.slice(0, m.index).split('\n').length });
  return found;
}

describe('README', () => {
  it('has TypeScript blocks that all type-check', () => {
    rmSync(work, { recursive: true, force: true });
    mkdirSync(work, { recursive: true });
    const all = blocks();
    expect(all.length).toBeGreaterThan(10);
    const files = all.map(({ code, line }) => {
      const named = /^\/\/ ([\w.-]+\.ts)\n/.exec(code)?.[1];
      const name = named ?? `block-line-${line}.ts`;
      let source: string;
      if (/^import /m.test(code)) source = code;
      else if (/^@\w+\([\s\S]*^(export )?class /m.test(code)) source = commonImports + code;
      else if (code.trimStart().startsWith('@')) source = `${commonImports}\nexport class Snippet {\n  [member: string]: any;\n  constructor(readonly locks: LockService) {}\n${code}}\n`;
      else source = `${commonImports}\nexport class Snippet {\n  [member: string]: any;\n  async run(): Promise<unknown> {\n${code}\n    return undefined;\n  }\n}\n`;
      writeFileSync(join(work, name), source);
      return name;
    });
    writeFileSync(join(work, 'ambient.d.ts'), ambient);
    writeFileSync(
      join(work, 'tsconfig.json'),
      JSON.stringify({
        compilerOptions: {
          target: 'ES2022',
          module: 'ESNext',
          moduleResolution: 'Bundler',
          experimentalDecorators: true,
          emitDecoratorMetadata: true,
          strict: true,
          noEmit: true,
          skipLibCheck: true,
          types: ['node'],
          typeRoots: [join(root, 'node_modules', '@types')],
          baseUrl: '.',
          paths: { 'nestjs-locked': [join(root, 'lib', 'index.ts')], '*': [join(root, 'node_modules', '*')] },
        },
        files: [...files, 'ambient.d.ts'],
      }),
    );
    const tsc = spawnSync(process.execPath, [join(root, 'node_modules', 'typescript', 'bin', 'tsc'), '-p', work], { encoding: 'utf8' });
    expect(tsc.stdout + tsc.stderr).toBe('');
    expect(tsc.status).toBe(0);
  });
});
