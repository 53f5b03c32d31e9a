// LangChain (`@langchain/openai` on `@langchain/core`) against infertap: node tests/js/langchain.mjs SCENARIO
// ChatOpenAI speaks Chat Completions, or the Responses API with useResponsesApi: true.
import { HumanMessage, ToolMessage } from "@langchain/core/messages";
import { ChatOpenAI, OpenAIEmbeddings } from "@langchain/openai";

import { API_KEY, BASE_URL, describeError, main, runTool } from "./common.mjs";

const MODEL = "sim-model";
const connection = { apiKey: API_KEY, maxRetries: 0, configuration: { baseURL: BASE_URL } };
const apis = { chat: {}, responses: { useResponsesApi: true } };
const chatModel = (api, fields = {}) => new ChatOpenAI({ model: MODEL, ...connection, ...apis[api], ...fields });

// Stream, merging the chunks as LangChain's users do (AIMessageChunk.concat merges tool-call chunks).
async function streamMessage(runnable, messages, options = {}) {
  let full = null;
  let deltas = 0;
  for await (const chunk of await runnable.stream(messages, options)) {
    if (chunk.text) deltas += 1;
    full = full === null ? chunk : full.concat(chunk);
  }
  return {
    message: full,
    text: full?.text ?? "",
    deltas,
    calls: (full?.tool_calls ?? []).map((c) => ({ id: c.id, name: c.name, args: c.args })),
    outputTokens: full?.usage_metadata?.output_tokens ?? null,
  };
}

async function streamAndWhole(api, { prompt, seed }) {
  const llm = chatModel(api, { temperature: 0 });
  const messages = [new HumanMessage(prompt)];
  const options = seed === undefined ? {} : { seed };
  const streamed = await streamMessage(llm, messages, options);
  const whole = await llm.invoke(messages, options);
  return {
    streamed: streamed.text,
    deltas: streamed.deltas,
    streamOutputTokens: streamed.outputTokens,
    whole: whole.text,
    wholeOutputTokens: whole.usage_metadata?.output_tokens ?? null,
    requests: 2,
  };
}

// The agent loop: bindTools, a forced first call, the ToolMessage back, the model's answer.
// first_choice: "required", or a tool's name (with useResponsesApi, @langchain/openai 1.5.8 drops the
// string tool_choices "required"/"auto"/"none" from the request; a named tool does reach the engine).
async function toolLoop(api, { prompt, tools, first_choice = "required" }) {
  const llm = chatModel(api, { temperature: 0 });
  const messages = [new HumanMessage(prompt)];
  const first = await streamMessage(llm.bindTools(tools, { tool_choice: first_choice }), messages);
  messages.push(first.message);
  const results = first.calls.map((c) => runTool(c.name, c.args));
  first.calls.forEach((c, i) => messages.push(new ToolMessage({ tool_call_id: c.id, content: JSON.stringify(results[i]) })));
  const second = await streamMessage(llm.bindTools(tools, { tool_choice: "auto" }), messages);
  return {
    calls: first.calls.map(({ name, args }) => ({ name, args })),
    results,
    text: second.text,
    secondCalls: second.calls.length,
    requests: 2,
  };
}

await main({
  chat_stream: (spec) => streamAndWhole("chat", spec),
  responses_stream: (spec) => streamAndWhole("responses", spec),

  async chat_tools({ prompt, tools, cases }) {
    const llm = chatModel("chat");
    const out = [];
    for (const { seed, tool_choice } of cases) {
      const r = await streamMessage(llm.bindTools(tools, { tool_choice }), [new HumanMessage(prompt)], { seed });
      out.push({ text: r.text, calls: r.calls.map(({ name, args }) => ({ name, args })) });
    }
    return { cases: out, requests: cases.length };
  },

  chat_tool_loop: (spec) => toolLoop("chat", spec),
  responses_tool_loop: (spec) => toolLoop("responses", spec),

  async embeddings({ input }) {
    const vector = await new OpenAIEmbeddings({ model: MODEL, ...connection }).embedQuery(input);
    return { vectors: [vector], requests: 1 };
  },

  async abort({ prompt, headers, route }) {
    const llm = chatModel(route ?? "chat", { configuration: { baseURL: BASE_URL, defaultHeaders: headers } });
    const controller = new AbortController();
    let deltas = 0;
    let error = null;
    try {
      for await (const chunk of await llm.stream([new HumanMessage(prompt)], { signal: controller.signal })) {
        if (chunk.text) {
          deltas += 1;
          controller.abort();
        }
      }
    } catch (err) {
      error = describeError(err);
    }
    return { deltas, aborted: controller.signal.aborted, error, requests: 1 };
  },

  async stream_failure({ prompt, model, route }) {
    let text = "";
    let deltas = 0;
    let error = null;
    try {
      for await (const chunk of await chatModel(route, { model }).stream([new HumanMessage(prompt)])) {
        if (chunk.text) {
          text += chunk.text;
          deltas += 1;
        }
      }
    } catch (err) {
      error = describeError(err);
    }
    return { text, deltas, errors: error ? [error] : [], requests: 1 };
  },

  async upstream_error({ prompt, model, temperature }) {
    const errors = {};
    for (const [api, route] of [["chat", "chat.completions"], ["responses", "responses"]]) {
      const llm = chatModel(api, { model, temperature });
      const attempts = {
        true: () => streamMessage(llm, [new HumanMessage(prompt)]),
        false: () => llm.invoke([new HumanMessage(prompt)]),
      };
      for (const [stream, attempt] of Object.entries(attempts)) {
        try {
          await attempt();
          errors[`${route}/${stream}`] = null;
        } catch (err) {
          errors[`${route}/${stream}`] = describeError(err);
        }
      }
    }
    return { errors, requests: 4 };
  },
});
