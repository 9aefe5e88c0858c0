import { LockConfigurationError } from '../errors/lock-configuration.error.js';
import { LockKeyError } from '../errors/lock-key.error.js';
import { assertLockKey } from '../lock-key.js';
import { describe } from '../lock-options.js';

/**
 * A `@Locked` key template, parsed once when the class is defined.
 *
 * Syntax: literal text with placeholders. `<n>` is the n-th argument the method receives (after
 * pipes); `<n.a.b>` reads the property path `a.b` of it. Example: `'transfer:<0.from>:<0.to>'`.
 *
 * Encoding: a placeholder's value must be a string, a finite number, a bigint or a boolean. Its
 * text is percent-encoded for `%`, `:`, `{` and `}` (as `%25`, `%3A`, `%7B`, `%7D`), and literal text
 * may contain none of `%`, `{`, `}`, `<`, `>`. So a value can never contain the `:` separator (it
 * cannot shift a `:` boundary and make the key of a template with another `:` structure), can never
 * fake an encoded sequence, and can never move the Cluster hash tag.
 */
export class LockKeyTemplate {
  private constructor(
    readonly source: string,
    private readonly parts: readonly Part[],
    readonly where: string,
  ) {}

  /**
   * Parses `source`; throws `LockConfigurationError` naming `where` (class and method) when it is
   * malformed or reads an argument beyond `declaredParameters` (when known).
   */
  static parse(source: string, where: string, declaredParameters: number | undefined): LockKeyTemplate {
    const fail = (why: string) =>
      new LockConfigurationError('template', `${where}: key template ${JSON.stringify(source)} ${why}.`);
    if (typeof source !== 'string' || source.length === 0) {
      throw new LockConfigurationError('template', `${where}: a key template must be a non-empty string; got ${describe(source)}.`);
    }
    const parts: Part[] = [];
    let i = 0;
    while (i < source.length) {
      const open = source.indexOf('<', i);
      const literal = source.slice(i, open === -1 ? source.length : open);
      const bad = /[%{}>]/.exec(literal);
      if (bad) {
        throw fail(
          bad[0] === '>'
            ? `has a ">" without a matching "<" at position ${i + bad.index}`
            : `contains "${bad[0]}" in its literal text; "%", "{" and "}" are reserved (values are percent-encoded, and nestjs-locked adds the hash tag)`,
        );
      }
      if (literal) parts.push({ literal });
      if (open === -1) break;
      const close = source.indexOf('>', open);
      if (close === -1) throw fail(`has an unclosed "<" at position ${open}`);
      const inner = source.slice(open + 1, close);
      if (inner.includes('<')) throw fail(`has a "<" inside the placeholder at position ${open}`);
      const [indexText, ...path] = inner.split('.');
      if (!indexText) throw fail(`has an empty placeholder "<${inner}>" at position ${open}; write <0> for the first argument`);
      if (!/^\d+$/.test(indexText)) {
        throw fail(`has placeholder "<${inner}>": the part before the first "." must be an argument index (0, 1, ...), not ${JSON.stringify(indexText)}`);
      }
      const index = Number(indexText);
      if (path.some((p) => p.length === 0)) throw fail(`has placeholder "<${inner}>" with an empty property name`);
      if (declaredParameters !== undefined && index >= declaredParameters) {
        throw fail(`reads argument <${index}> but the method declares ${declaredParameters} parameter(s)`);
      }
      parts.push({ index, path });
      i = close + 1;
    }
    return new LockKeyTemplate(source, parts, where);
  }

  /** The key for these (post-pipe) arguments. Throws `LockKeyError` when an argument cannot make a key. */
  resolve(args: readonly unknown[]): string {
    let key = '';
    for (const part of this.parts) {
      if ('literal' in part) {
        key += part.literal;
        continue;
      }
      let value: unknown = args[part.index];
      let reached = `argument <${part.index}>`;
      for (const name of part.path) {
        if (value === null || value === undefined || (typeof value !== 'object' && typeof value !== 'function')) {
          throw this.badValue(part, `${reached} is ${describe(value)}, so it has no property "${name}"`);
        }
        value = (value as Record<string, unknown>)[name];
        reached += `.${name}`;
      }
      key += encodeValue(value, () => this.badValue(part, `${reached} is ${describe(value)}`));
    }
    assertLockKey(key, this.where);
    return key;
  }

  private badValue(part: { index: number; path: readonly string[] }, why: string): LockKeyError {
    const placeholder = `<${[part.index, ...part.path].join('.')}>`;
    return new LockKeyError(
      `${this.where}: cannot build the lock key from template ${JSON.stringify(this.source)}: ${why}. ` +
        `Placeholder ${placeholder} needs a string, a finite number, a bigint or a boolean; use a property path (<0.id>) or a key function for objects.`,
      this.source,
    );
  }
}

type Part = { literal: string } | { index: number; path: readonly string[] };

function encodeValue(value: unknown, fail: () => LockKeyError): string {
  let text: string;
  if (typeof value === 'string') text = value;
  else if (typeof value === 'number' && Number.isFinite(value)) text = String(value);
  else if (typeof value === 'bigint' || typeof value === 'boolean') text = String(value);
  else throw fail();
  if (text.length === 0) throw fail();
  return /[%:{}]/.test(text) ? text.replace(/[%:{}]/g, (c) => ENCODED[c]!) : text;
}

const ENCODED: Record<string, string> = { '%': '%25', ':': '%3A', '{': '%7B', '}': '%7D' };
