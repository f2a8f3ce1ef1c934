package server

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/gwtest"
	"github.com/baton-llm/baton/internal/openai"
	"github.com/baton-llm/baton/internal/pd"
	"github.com/baton-llm/baton/internal/poll"
	"github.com/baton-llm/baton/internal/sim"
)

// streamedRecomputeIsCounted runs a NIXL PD stream whose decode answers with contentType and
// events (each "{id}" its answer's id, built from the request id as vLLM builds it), a recompute
// among them, and waits for baton_pd_handoffs_total to count it.
func streamedRecomputeIsCounted(t *testing.T, contentType string, events ...string) {
	t.Helper()
	p := pdSim(t, sim.Config{Engine: sim.EngineVLLM, Role: sim.RolePrefill, KVConnector: sim.ConnectorNixl})
	decode := vllmFake(t, "NixlConnector", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		id := "cmpl-" + r.Header.Get(openai.HeaderRequestID)
		w.Header().Set("Content-Type", contentType)
		for _, ev := range events {
			_, _ = io.WriteString(w, strings.ReplaceAll(ev, "{id}", id))
			w.(http.Flusher).Flush()
		}
	})
	s, gw, _ := gateway(t, nil, pdFleet(t, config.Worker{URL: p.URL(), Runtime: config.RuntimeVLLM, KVConnector: "NixlConnector", Models: []string{"m"}}, decode))
	resp, body := gwtest.PostTimeout(t, gw+"/v1/completions", `{"model":"m","prompt":"a recompute, spelled otherwise","max_tokens":2,"stream":true,"stream_options":{"include_usage":true}}`)
	if resp.StatusCode != 200 || !strings.Contains(body, "[DONE]") {
		t.Fatalf("stream: %d %s", resp.StatusCode, body)
	}
	poll.Until(t, "the recompute counted", func() bool {
		return testutil.ToFloat64(s.metrics.PDHandoffs.WithLabelValues("recomputed", pd.HandoffClass("recomputed"), "nixl")) == 1
	})
}

// A decode whose recompute event's payload begins with whitespace ("data:" and two spaces): a
// client's JSON parser reads it, and so does the check: the recompute is counted. The check used
// to pass it by.
func TestPDStreamCannotHideItsRecomputeBehindASpace(t *testing.T) {
	t.Parallel()
	streamedRecomputeIsCounted(t, "text/event-stream",
		`data: {"id":"{id}","choices":[{"index":0,"text":"y"}],"usage":{"prompt_tokens":40,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":40}}}`+"\n\n",
		`data:  {"id":"{id}","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}`+"\n\n",
		"data: [DONE]\n\n")
}

// A media type is case-insensitive (RFC 9110 8.3.1; the SDKs read a stream whatever its case): a
// decode that answers "Text/Event-Stream" is relayed and checked as a stream. It used to be taken
// for a whole JSON answer, held until it ended and checked as one document, which it is not: the
// recompute went uncounted.
func TestPDStreamCannotHideItsRecomputeBehindItsContentTypesCase(t *testing.T) {
	t.Parallel()
	streamedRecomputeIsCounted(t, "Text/Event-Stream",
		`data: {"id":"{id}","choices":[{"index":0,"text":"y"}]}`+"\n\n",
		`data: {"id":"{id}","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}`+"\n\n",
		"data: [DONE]\n\n")
}

// A decode stream whose lines end with lone CRs, as SSE allows: its events are the client's
// events, so a recompute its last usage says cannot hide behind an earlier event that said the
// KV was received. The relay used to find no event's end in such a stream, held it whole and
// checked it as one event, whose first usage it read.
func TestPDStreamWithLoneCRLinesShowsItsRecompute(t *testing.T) {
	t.Parallel()
	streamedRecomputeIsCounted(t, "text/event-stream",
		`data: {"id":"{id}","choices":[{"index":0,"text":"y"}],"usage":{"prompt_tokens":40,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":40}}}`+"\r\r",
		`data: {"id":"{id}","choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}`+"\r\r",
		"data: [DONE]\r\r")
}
