import { basename, dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

const up = join(dirname(fileURLToPath(import.meta.url)), '..', '..');

/** The repository's root, from the sources (Jest) and from their compiled copies in .test-build/ and .bench-build/ alike. */
export const repoRoot = /^\.(test|bench)-build$/.test(basename(up)) ? dirname(up) : up;
