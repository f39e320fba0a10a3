use proptest::prelude::*;

use super::*;

fn table_with_region(len: usize, granted: &str) -> (Arc<RegionTable>, Region) {
    let table = Arc::new(RegionTable::default());
    let region = table
        .register("owner".into(), RegionConfig::new(len).grant(granted))
        .unwrap();
    (table, region)
}

proptest! {
    /// Admission accepts a write exactly when the id and key match, the writer is granted and
    /// the bytes fit; otherwise it names the first failed check.
    #[test]
    fn admission_matches_the_rules(
        len in 0usize..4096,
        offset in prop_oneof![0u64..5000, Just(u64::MAX - 3)],
        write_len in 0u32..5000,
        right_key in any::<bool>(),
        right_id in any::<bool>(),
        granted in any::<bool>(),
    ) {
        let (table, region) = table_with_region(len, "writer");
        let descriptor = region.descriptor();
        let header = WriteHeader {
            seq: 0,
            region: if right_id { descriptor.id } else { descriptor.id + 1 },
            key: if right_key { descriptor.key } else { descriptor.key ^ 1 },
            offset,
            len: write_len,
            immediate: 0,
        };
        let writer = if granted { "writer" } else { "stranger" };
        let fits = offset.checked_add(u64::from(write_len)).is_some_and(|end| end <= len as u64);
        let expected = if !right_id {
            Err(NackReason::UnknownRegion)
        } else if !right_key {
            Err(NackReason::WrongKey)
        } else if !granted {
            Err(NackReason::NotGranted)
        } else if !fits {
            Err(NackReason::OutOfBounds)
        } else {
            Ok(())
        };
        prop_assert_eq!(table.admit(writer, &header).map(|_| ()), expected);
        prop_assert_eq!(descriptor.check_range(offset, u64::from(write_len)).is_ok(), fits);
    }
}

#[tokio::test]
async fn landing_writes_bytes_and_delivers_a_completion() {
    let (table, region) = table_with_region(16, "writer");
    let descriptor = region.descriptor();
    let header = WriteHeader {
        seq: 3,
        region: descriptor.id,
        key: descriptor.key,
        offset: 4,
        len: 6,
        immediate: 77,
    };
    let admitted = table.admit("writer", &header).unwrap();
    let mut landing = admitted.begin_landing(&header).await;
    landing.put(b"abc");
    landing.put(b"defXYZ"); // the extra bytes past the admitted length are ignored
    assert_eq!(landing.remaining(), 0);
    landing.finish("writer".into(), 9, &header);

    let completion = region.next_completion().await.unwrap();
    assert_eq!(
        (
            completion.offset,
            completion.len,
            completion.immediate,
            completion.channel
        ),
        (4, 6, 77, 9)
    );
    let view = region.read(completion.range()).await.unwrap();
    assert_eq!(&*view, b"abcdef");
    drop(view);
    let whole = region.read(0..16).await.unwrap();
    assert_eq!(&whole[..4], &[0; 4]);
    assert_eq!(&whole[10..], &[0; 6]);
}

#[tokio::test]
async fn dropping_a_region_deregisters_it() {
    let (table, region) = table_with_region(8, "writer");
    let descriptor = region.descriptor();
    let header = WriteHeader {
        seq: 0,
        region: descriptor.id,
        key: descriptor.key,
        offset: 0,
        len: 1,
        immediate: 0,
    };
    assert!(table.admit("writer", &header).is_ok());
    drop(region);
    assert_eq!(
        table.admit("writer", &header).map(|_| ()),
        Err(NackReason::UnknownRegion)
    );
}

#[tokio::test]
async fn grant_and_revoke_change_admission() {
    let (table, region) = table_with_region(8, "writer");
    let descriptor = region.descriptor();
    let header = WriteHeader {
        seq: 0,
        region: descriptor.id,
        key: descriptor.key,
        offset: 0,
        len: 8,
        immediate: 0,
    };
    assert_eq!(
        table.admit("late", &header).map(|_| ()),
        Err(NackReason::NotGranted)
    );
    region.grant("late");
    assert!(table.admit("late", &header).is_ok());
    region.revoke("late");
    assert_eq!(
        table.admit("late", &header).map(|_| ()),
        Err(NackReason::NotGranted)
    );
}

#[tokio::test]
async fn local_views_are_bounds_checked() {
    let (_table, region) = table_with_region(8, "writer");
    assert!(matches!(
        region.read(4..9).await,
        Err(Error::OutOfBounds { .. })
    ));
    #[allow(clippy::reversed_empty_ranges)]
    let reversed = 5..4;
    assert!(matches!(
        region.read(reversed).await,
        Err(Error::OutOfBounds { .. })
    ));
    region
        .write_local(2..4)
        .await
        .unwrap()
        .copy_from_slice(&[7, 8]);
    assert_eq!(
        &*region.read(0..8).await.unwrap(),
        &[0, 0, 7, 8, 0, 0, 0, 0]
    );
}

#[test]
fn descriptors_survive_serde() {
    let descriptor = RegionDescriptor {
        node: "card-0".into(),
        id: 3,
        len: 4096,
        key: 0xdead_beef_0123_4567,
    };
    let text = serde_json::to_string(&descriptor).unwrap();
    assert_eq!(
        serde_json::from_str::<RegionDescriptor>(&text).unwrap(),
        descriptor
    );
}

#[test]
fn blocking_completion_wait_times_out_cleanly() {
    let (_table, region) = table_with_region(8, "writer");
    let error = region
        .next_completion_blocking(Duration::from_millis(5))
        .unwrap_err();
    assert!(matches!(error, Error::Timeout { .. }), "{error}");
}
