package proxy

import (
	"context"
	"fmt"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/baton-llm/baton/internal/config"
	"github.com/baton-llm/baton/internal/worker"
)

// newPost parses a worker's URL once per path; the request it makes must be the one
// http.NewRequestWithContext makes for URL+path, whatever the URL holds, on the first call for a
// path and on every later one, and past the bound on the paths a worker keeps.
func TestNewPostMakesTheRequestNewRequestMakes(t *testing.T) {
	type key struct{}
	ctx := context.WithValue(context.Background(), key{}, "leg")
	urls := []string{
		"http://127.0.0.1:8000",
		"http://127.0.0.1:8000/",
		"http://[::1]:8000",
		"http://[::1]:",
		"http://engine:",
		"https://engine",
		"http://user:p%40ss@engine:8000",
		"http://engine:8000/prefix/v2",
		"http://engine:8000/a%2Fb",
		"http://engine:8000/?tenant=a",
		"http://engine:8000/#frag",
		"http://éngine:8000/ünï",
		"http://engine:8000/\x7f",
		"http://engine:8000/bad\x00",
		"http://[::1",
		"engine:8000",
		"/relative",
		"",
	}
	paths := []string{"/v1/chat/completions", "/v1/completions", "", "/v1/x%20y", "/v1/é", "/v1/\x01", "?q=1"}
	for i := range 40 { // past the bound on the paths a worker keeps
		paths = append(paths, fmt.Sprintf("/v1/route%d", i))
	}
	for _, u := range urls {
		w := worker.New(config.Worker{URL: u})
		for round := range 2 { // the first call parses, the second takes the kept URL
			for _, p := range paths {
				want, wantErr := http.NewRequestWithContext(ctx, http.MethodPost, w.URL+p, strings.NewReader("{}"))
				got, err := newPost(ctx, w, p, strings.NewReader("{}"))
				if (err != nil) != (wantErr != nil) || (err != nil && err.Error() != wantErr.Error()) {
					t.Fatalf("round %d, %q + %q: error %v, NewRequest's %v", round, w.URL, p, err, wantErr)
				}
				if err != nil {
					continue
				}
				if !reflect.DeepEqual(got.URL, want.URL) || got.Host != want.Host || got.Method != want.Method ||
					got.Proto != want.Proto || got.ProtoMajor != want.ProtoMajor || got.ProtoMinor != want.ProtoMinor ||
					!reflect.DeepEqual(got.Header, want.Header) || got.ContentLength != want.ContentLength ||
					got.Context() != want.Context() || got.URL.String() != want.URL.String() {
					t.Fatalf("round %d, %q + %q:\n got  %+v host %q\n want %+v host %q", round, w.URL, p, got.URL, got.Host, want.URL, want.Host)
				}
				// The request's URL is its own: changing it leaves the worker's kept one as it was.
				got.URL.Path, got.URL.RawQuery = "/changed", "x=1"
				if again, _ := w.Target(p); reflect.DeepEqual(again, got.URL) {
					t.Fatalf("%q + %q: the kept URL changed with a request's", w.URL, p)
				}
			}
		}
	}
}
