package routes

import (
	"slices"
	"testing"
)

// The table holds together: one row per path; PD and vLLM-handoff routes are inference routes;
// a route SGLang pairs take or vLLM hands off on goes through PD; what /tokenize takes is one of
// the prompt members; a path not listed gets the empty row.
func TestTableIsConsistent(t *testing.T) {
	seen := map[string]bool{}
	for _, r := range table {
		if seen[r.Path] {
			t.Errorf("%s listed twice", r.Path)
		}
		seen[r.Path] = true
		if Of(r.Path).Path != r.Path {
			t.Errorf("Of(%s) is not its row", r.Path)
		}
		if r.PD && !r.Inference {
			t.Errorf("%s goes through PD but is not an inference route", r.Path)
		}
		if (r.VLLMHandoff || r.SGLangPD) && !r.PD {
			t.Errorf("%s hands KV off but does not go through PD", r.Path)
		}
		if r.PD && r.Cap == "" {
			t.Errorf("%s goes through PD without a generation cap for the probe", r.Path)
		}
		if r.Tokenize != "" && !slices.Contains(r.Prompt, r.Tokenize) {
			t.Errorf("%s tokenizes %q, not one of its prompt members %v", r.Path, r.Tokenize, r.Prompt)
		}
	}
	if r := Of("/v1/unknown"); r.Inference || r.PD || r.SGLangOnly || r.VLLMHandoff || len(r.Prompt) != 0 {
		t.Errorf("an unlisted path has a row: %+v", r)
	}
	var paths []string
	for _, r := range Inference() {
		paths = append(paths, r.Path)
	}
	if !slices.Equal(paths, []string{"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/generate", "/v1/embeddings", "/v1/rerank", "/rerank"}) {
		t.Errorf("inference routes %v", paths)
	}
}
