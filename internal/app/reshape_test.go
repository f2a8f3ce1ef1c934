package app

import (
	"strings"
	"testing"

	"github.com/baton-llm/baton/internal/sim"
)

// Issue 24, item 3: Baton's readers disagreed on a repeated top-level key (the request parser
// kept the last, the field reader the first) and the engines' JSON keeps the last: a short
// "prompt" first and a batch second passed --max-batch-size and reached the engine as the batch.
// A repeated top-level key is refused, however it is spelled.
func TestDuplicateTopLevelKeysAreRefused(t *testing.T) {
	t.Parallel()
	e := simEngine(t, sim.Config{Engine: sim.EngineSGLang})
	cfg := testConfig(e.URL())
	cfg.MaxBatchSize = 4
	_, gw := startGateway(t, cfg)
	for _, tc := range []struct{ route, body, key string }{
		{"/v1/completions", `{"model":"m","prompt":"x","prompt":["a","b","c","d","e"],"max_tokens":1}`, "prompt"},
		{"/generate", `{"text":"a","text":["a","b","c","d","e"],"sampling_params":{"max_new_tokens":1}}`, "text"},
		{"/v1/chat/completions", `{"model":"m","messages":[],"mod\u0065l":"other"}`, "model"},
		{"/v1/completions", `{"model":"m","prompt":"x","n":1,"n":9}`, "n"},
	} {
		env := wantEnvelope(t, post(t, gw.URL+tc.route, tc.body), 400, "duplicate_key")
		if env.Error.Param == nil || *env.Error.Param != tc.key || !strings.Contains(env.Error.Message, tc.key) {
			t.Errorf("%s: the answer does not name %q: %+v", tc.body, tc.key, env)
		}
	}
	if resp, body := postTimeout(t, gw.URL+"/v1/completions", `{"model":"m","prompt":["a","b"],"max_tokens":1,"x":{"prompt":1,"prompt":2}}`); resp.StatusCode != 200 {
		t.Errorf("a repeated key inside a nested object is the engine's business: %d %s", resp.StatusCode, body)
	}
}
