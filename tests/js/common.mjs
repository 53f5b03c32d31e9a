// Shared by the client scripts: what tests/test_js_clients.py passes in, and how a result goes back.
//
//   node tests/js/<client>.mjs SCENARIO
//   INFERTAP_BASE_URL   infertap's OpenAI base URL (http://127.0.0.1:PORT/v1)
//   INFERTAP_JS_SPEC    the scenario's parameters, as JSON (prompt, seeds, tools, ...)
//
// The script prints one JSON object on stdout (its last line) and exits 0; anything unexpected
// throws, so node prints the stack on stderr and exits 1.

export const BASE_URL = process.env.INFERTAP_BASE_URL;
export const SPEC = JSON.parse(process.env.INFERTAP_JS_SPEC ?? "{}");
export const API_KEY = "unused-by-infertap";

// A tool's result in the agent loops: fixed, so the test can tell it was sent back.
export function runTool(name, args) {
  return { tool: name, args, result: "sunny, 21 degrees" };
}

// An error as the client threw it: what a user's catch block sees.
export function describeError(err) {
  return {
    name: err?.constructor?.name ?? typeof err,
    message: String(err?.message ?? err),
    status: err?.status ?? err?.statusCode ?? null,
  };
}

export async function main(scenarios) {
  if (!BASE_URL) throw new Error("INFERTAP_BASE_URL is not set");
  const name = process.argv[2];
  const scenario = scenarios[name];
  if (!scenario) {
    console.error(`unknown scenario ${JSON.stringify(name)}; one of: ${Object.keys(scenarios).join(", ")}`);
    process.exit(2);
  }
  const result = await scenario(SPEC);
  // Exit once stdout is written: an aborted stream must not keep the process alive.
  process.stdout.write(JSON.stringify(result) + "\n", () => process.exit(0));
}
