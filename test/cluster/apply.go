package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/types"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"
)

// fieldManager owns the fields Apply sets.
const fieldManager = "tessera-test"

// Apply server-side applies every object in a multi-document YAML (or JSON)
// stream, in order, like `kubectl apply --server-side --force-conflicts`.
// Namespaced objects without a namespace go to "default".
func (c *Cluster) Apply(ctx context.Context, manifests []byte) error {
	dyn, err := dynamic.NewForConfig(c.restConfig)
	if err != nil {
		return fmt.Errorf("create dynamic client: %w", err)
	}
	disco, err := discovery.NewDiscoveryClientForConfig(c.restConfig)
	if err != nil {
		return fmt.Errorf("create discovery client: %w", err)
	}
	cached := memory.NewMemCacheClient(disco)
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(cached)

	decoder := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(manifests), 4096)
	for i := 0; ; i++ {
		var obj unstructured.Unstructured
		if err := decoder.Decode(&obj.Object); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return fmt.Errorf("decode document %d: %w", i, err)
		}
		if len(obj.Object) == 0 {
			continue // an empty document between separators
		}
		if err := applyOne(ctx, dyn, mapper, cached, &obj); err != nil {
			return fmt.Errorf("apply document %d (%s %s): %w", i, obj.GetKind(), obj.GetName(), err)
		}
	}
}

func applyOne(ctx context.Context, dyn dynamic.Interface, mapper *restmapper.DeferredDiscoveryRESTMapper,
	cached discovery.CachedDiscoveryInterface, obj *unstructured.Unstructured) error {
	gvk := obj.GroupVersionKind()
	mapping, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	if meta.IsNoMatchError(err) {
		// A CRD applied earlier in the stream: refresh discovery once.
		cached.Invalidate()
		mapper.Reset()
		mapping, err = mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
	}
	if err != nil {
		return fmt.Errorf("find resource for %s: %w", gvk, err)
	}
	data, err := obj.MarshalJSON()
	if err != nil {
		return fmt.Errorf("encode: %w", err)
	}
	var resource dynamic.ResourceInterface = dyn.Resource(mapping.Resource)
	if mapping.Scope.Name() == meta.RESTScopeNameNamespace {
		ns := obj.GetNamespace()
		if ns == "" {
			ns = metav1.NamespaceDefault
		}
		resource = dyn.Resource(mapping.Resource).Namespace(ns)
	}
	force := true
	_, err = resource.Patch(ctx, obj.GetName(), types.ApplyPatchType, data,
		metav1.PatchOptions{FieldManager: fieldManager, Force: &force})
	return err
}
