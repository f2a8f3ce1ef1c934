package sim

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, goleak.IgnoreTopFunction("internal/poll.runtime_pollWait"),
		goleak.IgnoreTopFunction("net/http.(*persistConn).writeLoop"), goleak.IgnoreTopFunction("net/http.(*persistConn).readLoop"))
}

// BenchmarkSim measures the simulator's own cost per request, so gateway benchmarks can show it
// is not the bottleneck: a 16-token chat answer, non-streamed and streamed (18 events).
func BenchmarkSim(b *testing.B) {
	e := start(b, Config{Model: "m"})
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16}}
	for _, tc := range []struct{ name, body string }{
		{"chat", `{"model":"m","messages":[{"role":"user","content":"benchmark prompt with a few words"}],"max_tokens":16,"ignore_eos":true}`},
		{"chat-stream", `{"model":"m","messages":[{"role":"user","content":"benchmark prompt with a few words"}],"max_tokens":16,"ignore_eos":true,"stream":true}`},
	} {
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				resp, err := client.Post(e.URL()+"/v1/chat/completions", "application/json", strings.NewReader(tc.body))
				if err != nil {
					b.Fatal(err)
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					b.Fatal(resp.StatusCode)
				}
			}
		})
	}
	client.CloseIdleConnections()
}
